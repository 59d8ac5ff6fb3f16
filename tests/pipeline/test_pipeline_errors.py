"""What goes wrong in a pipeline is a clear error: failing stages, sizes that do not divide, unknown schedules."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

FAILING_STAGE = """
import torch
from torch import nn
import epl

class Fragile(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 6:
            raise ValueError("stage 1 cannot digest this micro-batch")
        return self.lin(x)

epl.init(epl.Config({"pipeline.num_micro_batch": 2}))
with epl.replicate(1, name="stage_0"):
    first = nn.Linear(4, 4)
with epl.replicate(1, name="stage_1"):
    second = Fragile()
engine = epl.parallelize(nn.Sequential(first, second), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                         loss_fn=nn.MSELoss())
for step in range(5):
    torch.manual_seed(step)  # every rank of the replica is given the same batch
    engine.step(torch.randn(4, 4), torch.randn(4, 4))
"""


@pytest.mark.multiprocess
def test_a_stage_that_raises_ends_the_job_with_its_error(tmp_path: Path) -> None:
    script = tmp_path / "fragile.py"
    script.write_text(textwrap.dedent(FAILING_STAGE))
    epl = shutil.which("epl", path=str(Path(sys.executable).parent)) or "epl"
    started = time.monotonic()
    done = subprocess.run(
        [epl, "launch", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"), str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    took = time.monotonic() - started
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "ValueError: stage 1 cannot digest this micro-batch" in output
    assert "rank 1" in output
    assert took < 60, f"the job took {took:.0f}s to end"


def test_sizes_that_do_not_divide_are_named() -> None:
    import epl
    from epl.errors import EplError, PlacementError
    from epl.runtime.batch import split_batch

    epl.init(epl.Config({"pipeline.num_micro_batch": 4}))
    with epl.replicate(1, name="a"):
        a = nn.Linear(2, 2)
    with epl.replicate(1, name="b"):
        b = nn.Linear(2, 2)
    with pytest.raises(PlacementError, match="3"):
        epl.plan(nn.Sequential(a, b), world_size=3)
    with pytest.raises(EplError, match="pipeline.num_micro_batch=4"):
        split_batch(torch.zeros(6, 2), 4, what="pipeline.num_micro_batch=4")


def test_an_unknown_schedule_names_the_registered_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from epl.plugins import reset_plugin_manager

    monkeypatch.setenv("EPL_DISABLE_EXTERNAL_PLUGINS", "epl-example-plugin")  # EPL's own schedules only
    reset_plugin_manager()

    import epl
    from epl.errors import EplError
    from epl_pipeline.plugin import _schedule

    env = epl.init(epl.Config({"pipeline.strategy": "ZeroBuble"}))
    context = SimpleNamespace(config=env.config, plugins=env.plugins)
    with pytest.raises(
        EplError,
        match=r"registered: Interleaved1F1B, PreferBackward, PreferForward, ZeroBubble\. Did you mean 'ZeroBubble'",
    ):
        _schedule(context, 2, 4)  # type: ignore[arg-type]


def _tied_across_stages() -> str:
    import torch
    from torch import nn

    import epl

    epl.init(epl.Config({"pipeline.num_micro_batch": 2}))
    with epl.replicate(1, name="s0"):
        embedding = nn.Embedding(10, 4)
    with epl.replicate(1, name="s1"):
        head = nn.Linear(4, 10, bias=False)
    head.weight = embedding.weight
    try:
        epl.parallelize(nn.Sequential(embedding, head), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    except epl.PlacementError as exc:
        return str(exc)
    return "no error"


def test_weights_tied_across_stages_are_named() -> None:
    from tests.helpers.distributed import run_ranks

    for message in run_ranks(_tied_across_stages, 2, timeout=60):
        assert "Pipeline stage 's1' holds no module" in message
