"""A resumed run continues exactly; a crash while saving leaves the previous checkpoint; weights export."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import epl
from epl.plugin_api import local_tensor
from tests.checkpoints.test_layouts import Net, batch, engine_for, step
from tests.helpers.distributed import run_ranks


def straight_and_resumed(layout: str, folder: str) -> dict[str, Any]:
    """Four steps straight; and two steps, save, a fresh engine loads, two steps. Dropout on."""
    engine = engine_for(layout, dropout=0.3)
    straight = [step(engine, i) for i in range(2)]
    engine.save(Path(folder) / layout)
    straight += [step(engine, i) for i in range(2, 4)]
    # Read before the next epl.init, which releases this engine's process groups; under ZeRO, this rank's chunks.
    straight_weights = [local_tensor(value).clone() for value in engine.model.state_dict().values()]
    scalers = [engine.loss_scaler]
    torch.manual_seed(12345)  # the fresh engine must not depend on the generator's state: the checkpoint has it
    resumed_engine = engine_for(layout, dropout=0.3)
    resumed_engine.load(Path(folder) / layout)
    resumed = straight[:2] + [step(resumed_engine, i) for i in range(2, 4)]
    scalers.append(resumed_engine.loss_scaler)
    return {
        "straight": straight,
        "resumed": resumed,
        "scales": [None if scaler is None else (scaler.scale, scaler.skipped_steps) for scaler in scalers],
        "same_weights": all(
            torch.equal(a, local_tensor(b))
            for a, b in zip(straight_weights, resumed_engine.model.state_dict().values(), strict=True)
        ),
    }


def test_a_resumed_run_has_exactly_the_losses_of_an_uninterrupted_one(tmp_path: Path) -> None:
    """Random state (dropout), AdamW states and the step counter come back: bit for bit."""
    for layout in ("local", "amp"):  # amp: the loss scale grows every step, and must come back
        local = straight_and_resumed(layout, str(tmp_path))
        assert local["resumed"] == local["straight"] and local["same_weights"]
        assert local["scales"][0] == local["scales"][1]
    assert local["scales"][0] == (2.0**19, 0)  # 2^15, doubled after each of the 4 steps
    for result in run_ranks(straight_and_resumed, 2, "zero v2", str(tmp_path), timeout=180):
        assert result["resumed"] == result["straight"] and result["same_weights"]
    for result in run_ranks(straight_and_resumed, 4, "pipeline 2x2", str(tmp_path), timeout=240):
        assert result["resumed"] == result["straight"] and result["same_weights"]


def test_a_crash_while_saving_leaves_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "checkpoint"
    engine = engine_for("local")
    step(engine, 0)
    engine.save(path)
    saved = {key: value.clone() for key, value in engine.model.state_dict().items()}
    step(engine, 1)

    def crash(state_dict: dict[str, Any], *, storage_writer: Any, **_: Any) -> None:
        folder = Path(str(storage_writer.path))
        folder.mkdir(parents=True)
        (folder / "__0_0.distcp").write_bytes(b"half written")
        raise RuntimeError("the machine went down while saving")

    monkeypatch.setattr(dcp, "save", crash)
    with pytest.raises(RuntimeError, match="went down"):
        engine.save(path)
    monkeypatch.undo()

    fresh = engine_for("local")
    fresh.load(path)
    for key, value in saved.items():
        assert torch.equal(fresh.model.state_dict()[key], value), key
    engine.save(path)  # the next save replaces the half-written one
    assert not (tmp_path / "checkpoint.partial").exists()

    # a save cut off between its two renames: the previous checkpoint is read from its old name
    path.rename(tmp_path / "checkpoint.old")
    fresh.load(path)
    with pytest.raises(epl.EplError, match="No EPL checkpoint"):
        fresh.load(tmp_path / "nowhere")


def test_whole_weights_export_for_use_outside_epl(tmp_path: Path) -> None:
    results = run_ranks(_save_split, 2, str(tmp_path), timeout=120)
    weights = epl.read_model_state(tmp_path / "split")
    plain = Net().double()
    plain.load_state_dict(weights)  # the model as written, no EPL
    x, _ = batch(7)
    torch.testing.assert_close(plain(x), results[0], rtol=1e-12, atol=1e-12)


def _save_split(folder: str) -> torch.Tensor:
    engine = engine_for("split")
    step(engine, 0)
    engine.save(Path(folder) / "split")
    return engine.predict(batch(7)[0])


def test_loading_another_models_checkpoint_names_what_is_missing(tmp_path: Path) -> None:
    engine = engine_for("local")
    engine.save(tmp_path / "checkpoint")
    epl.init(epl.Config({}))
    other = epl.parallelize(nn.Sequential(nn.Linear(8, 4)).double(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.raises(epl.EplError, match="has no 0.weight, 0.bias"):
        other.load(tmp_path / "checkpoint")
