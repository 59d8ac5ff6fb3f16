"""A checkpoint written before the checkpoint modules became a package still loads, with its values.

``fixtures/format3/`` was written by ``fixtures/make_format3.py`` with that EPL (one process, ``nn.Linear(3, 2)``,
AdamW, one step); ``fixtures/format3.json`` holds what it saved.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import nn

import epl

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def test_a_checkpoint_of_the_epl_before_the_package_loads(tmp_path: Path) -> None:
    expected = json.loads((FIXTURES / "format3.json").read_text())
    folder = tmp_path / "format3"
    shutil.copytree(FIXTURES / "format3", folder)  # a load leaves it as it is, but never the repository's copy
    epl.init(epl.Config({}))
    torch.manual_seed(1)  # other weights than the saved ones
    engine = epl.parallelize(nn.Linear(3, 2), optimizer=lambda p: torch.optim.AdamW(p, lr=0.1), loss_fn=nn.MSELoss())
    engine.load(folder)
    assert engine.global_step == expected["global_step"]
    for key, value in engine.model.state_dict().items():
        assert torch.equal(value, torch.tensor(expected["model"][key], dtype=value.dtype)), key
    for name, param in engine.model.named_parameters():
        state = engine.optimizer.state[param]
        assert sorted(state) == sorted(expected["optim"][name]), name
        for key, value in state.items():
            assert torch.equal(value, torch.tensor(expected["optim"][name][key], dtype=value.dtype)), (name, key)
    assert epl.read_model_state(folder).keys() == expected["model"].keys()
    engine.save(tmp_path / "again")  # and this EPL saves what it loaded, which loads again
    engine.load(tmp_path / "again")
    assert engine.global_step == expected["global_step"]
