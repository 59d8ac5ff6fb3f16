"""An LR scheduler registered with the engine steps with the optimizer and comes back from a checkpoint bit for bit."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import epl
from tests.checkpoints.test_layouts import Net, batch, step
from tests.helpers.distributed import run_ranks

STEPS, WARMUP = 6, 2


def warmup_then_cosine(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warm-up over WARMUP steps, then cosine decay to zero at STEPS (what a transformers script uses)."""

    def factor(step: int) -> float:
        if step < WARMUP:
            return (step + 1) / WARMUP
        return 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def engine(config: dict[str, Any] | None = None) -> epl.Engine:
    epl.init(epl.Config(config or {}))
    torch.manual_seed(0)
    return epl.parallelize(
        Net().double(),
        optimizer=lambda p: torch.optim.AdamW(p, lr=0.01),
        loss_fn=nn.MSELoss(),
        lr_scheduler=warmup_then_cosine,
    )


def straight_and_resumed(folder: str) -> dict[str, Any]:
    """STEPS steps straight; and half of them, save, a fresh engine loads, the other half."""
    first = engine()
    straight, lrs = [], []
    for index in range(STEPS):
        straight.append(step(first, index))
        lrs.append(first.lr)
        if index == STEPS // 2 - 1:
            first.save(Path(folder) / "checkpoint")
    weights = [value.clone() for value in first.model.state_dict().values()]
    resumed_engine = engine()
    resumed_engine.load(Path(folder) / "checkpoint")
    assert resumed_engine.lr_scheduler is not None
    resumed, resumed_lrs = [], []
    for index in range(STEPS // 2, STEPS):
        resumed.append(step(resumed_engine, index))
        resumed_lrs.append(resumed_engine.lr)
    return {
        "straight": straight[STEPS // 2 :],
        "resumed": resumed,
        "lrs": lrs,
        "resumed_lrs": resumed_lrs,
        "same_weights": all(
            torch.equal(a, b) for a, b in zip(weights, resumed_engine.model.state_dict().values(), strict=True)
        ),
        "scheduler_state": resumed_engine.lr_scheduler.state_dict()["last_epoch"],
    }


def expected_lrs() -> list[float]:
    model = nn.Linear(1, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = warmup_then_cosine(optimizer)
    lrs = []
    for _ in range(STEPS):
        optimizer.step()
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


def test_the_scheduler_steps_with_the_optimizer_and_resumes_exactly(tmp_path: Path) -> None:
    result = straight_and_resumed(str(tmp_path))
    assert result["lrs"] == expected_lrs()
    assert result["resumed"] == result["straight"] and result["same_weights"]
    assert result["resumed_lrs"] == result["lrs"][STEPS // 2 :] and result["scheduler_state"] == STEPS


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_scheduler_resumes_exactly_on_two_replicas(tmp_path: Path) -> None:
    for result in run_ranks(straight_and_resumed, 2, str(tmp_path), timeout=100):
        assert result["resumed"] == result["straight"] and result["same_weights"]
        assert result["lrs"] == expected_lrs() and result["resumed_lrs"] == result["lrs"][STEPS // 2 :]


def test_a_checkpoint_without_the_scheduler_is_refused_unless_not_strict(tmp_path: Path) -> None:
    epl.init(epl.Config({}))
    torch.manual_seed(0)
    plain = epl.parallelize(Net().double(), optimizer=lambda p: torch.optim.AdamW(p, lr=0.01), loss_fn=nn.MSELoss())
    step(plain, 0)
    plain.save(tmp_path / "plain")
    scheduled = engine()
    with pytest.raises(epl.EplError, match="no LR scheduler state"):
        scheduled.load(tmp_path / "plain")
    scheduled.load(tmp_path / "plain", strict=False)
    assert scheduled.lr_scheduler is not None and scheduled.lr_scheduler.last_epoch == 0


def test_a_scheduler_over_another_optimizer_is_refused() -> None:
    built = engine()
    other = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    with pytest.raises(epl.EplError, match="built over engine.optimizer"):
        built.lr_scheduler = torch.optim.lr_scheduler.StepLR(other, 1)
    epl.init(epl.Config({}))
    with pytest.raises(epl.EplError, match="no optimizer"):
        epl.parallelize(Net(), lr_scheduler=warmup_then_cosine)


def test_reduce_on_plateau_is_left_to_the_script() -> None:
    epl.init(epl.Config({}))
    torch.manual_seed(0)
    built = epl.parallelize(Net().double(), optimizer=lambda p: torch.optim.AdamW(p, lr=0.01), loss_fn=nn.MSELoss())
    assert built.optimizer is not None
    built.lr_scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(built.optimizer, patience=0, factor=0.5)
    x, y = batch(0)
    built.step(x, y)  # no metric: the engine does not step it
    built.lr_scheduler.step(1.0)
    built.lr_scheduler.step(2.0)
    assert built.lr == 0.005
