"""ZeRO v0 trains exactly like plain data parallelism and keeps 1/N of the optimizer state per device."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import epl
from epl_memory.zero import balanced_partition
from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.multiprocess

OPTIMIZERS = {
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
}


def build() -> nn.Module:
    """Uneven parameter sizes: 12x40, 40, 40x7, 7, 7x3, 3."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def train(optimizer: str, zero: str, micro_batches: int = 1) -> dict[str, Any]:
    env = epl.init(epl.Config({"zero.level": zero, "pipeline.num_micro_batch": micro_batches}))
    engine = epl.parallelize(build(), optimizer=OPTIMIZERS[optimizer], loss_fn=nn.MSELoss())
    scheduler = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x = torch.randn(16, 12, generator=generator, dtype=torch.float64)
        y = torch.randn(16, 3, generator=generator, dtype=torch.float64)
        rows = slice(8 * engine.replica_index, 8 * (engine.replica_index + 1))
        losses.append(float(engine.step(x[rows], y[rows])))
        scheduler.step()
    state_bytes = getattr(engine.optimizer, "state_bytes", None)
    return {
        "rank": env.cluster.rank,
        "losses": losses,
        "state": {k: v.clone() for k, v in engine.model.state_dict().items()},
        "state_bytes": state_bytes() if state_bytes else None,
        "optimizer_state": engine.state_dict()["optimizer"],
    }


def both(optimizer: str, micro_batches: int) -> dict[str, Any]:
    return {
        "plain": train(optimizer, "", micro_batches),
        "zero": train(optimizer, "v0", micro_batches),
    }


@pytest.mark.parametrize(("optimizer", "micro_batches"), [("adam", 1), ("adamw", 2), ("sgd", 1)])
def test_zero_v0_equals_plain_data_parallelism(optimizer: str, micro_batches: int) -> None:
    results = run_ranks(both, 2, optimizer, micro_batches, timeout=120)
    psi = sum(p.numel() for p in build().parameters())
    per_element = {"adam": 16, "adamw": 16, "sgd": 8}[optimizer]  # exp_avg + exp_avg_sq, or momentum (float64)
    for result in results:
        assert result["zero"]["losses"] == result["plain"]["losses"]
        for key, value in result["plain"]["state"].items():
            assert torch.equal(result["zero"]["state"][key], value), key
    owned = [r["zero"]["state_bytes"] for r in results]
    assert sum(owned) == per_element * psi  # the whole state, once, over the two devices
    assert max(owned) <= 0.5 * per_element * psi + per_element * 40 * 7  # about half each, up to one tensor


def test_partition_is_balanced_and_deterministic() -> None:
    params = [nn.Parameter(torch.empty(n)) for n in (480, 40, 280, 7, 21, 3)]
    parts = balanced_partition(params, 2)
    assert [sum(p.numel() for p in part) for part in parts] == [480, 351]
    assert balanced_partition(params, 2) == parts
    assert sorted(id(p) for part in balanced_partition(params, 4) for p in part) == sorted(id(p) for p in params)


@pytest.mark.filterwarnings("ignore")
def test_zero_levels_not_built_yet_are_an_error() -> None:
    with pytest.raises(epl.ConfigError, match="implements v0 .* only so far"):
        epl.init(epl.Config({"zero.level": "v1"}))
        epl.parallelize(build(), optimizer=OPTIMIZERS["adam"])
