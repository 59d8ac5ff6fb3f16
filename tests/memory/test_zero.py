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


LEVELS = ("v0", "v1", "v2")


def train(optimizer: str, zero: str, micro_batches: int = 1) -> dict[str, Any]:
    env = epl.init(epl.Config({"zero.level": zero, "pipeline.num_micro_batch": micro_batches}))
    engine = epl.parallelize(build(), optimizer=OPTIMIZERS[optimizer], loss_fn=nn.MSELoss())
    scheduler = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5)
    generator = torch.Generator().manual_seed(1)
    losses = []
    share = 16 // engine.num_replicas
    for _ in range(3):
        x = torch.randn(16, 12, generator=generator, dtype=torch.float64)
        y = torch.randn(16, 3, generator=generator, dtype=torch.float64)
        rows = slice(share * engine.replica_index, share * (engine.replica_index + 1))
        losses.append(float(engine.step(x[rows], y[rows])))
        scheduler.step()
    report = engine.memory_report()
    partitions = getattr(engine.optimizer, "partitions", [])
    return {
        "rank": env.cluster.rank,
        "losses": losses,
        "state": {k: v.clone() for k, v in engine.model.state_dict().items()},
        "bytes": (report.parameter_bytes, report.gradient_bytes, report.optimizer_state_bytes),
        "owned_bytes": sum(p.numel() * p.element_size() for part in partitions for p in part.mine),
        "optimizer_state": engine.state_dict()["optimizer"],
    }


def every_level(optimizer: str, micro_batches: int) -> dict[str, Any]:
    return {level or "plain": train(optimizer, level, micro_batches) for level in ("", *LEVELS)}


@pytest.mark.parametrize(("optimizer", "micro_batches"), [("adam", 1), ("adamw", 2), ("sgd", 1)])
def test_zero_equals_plain_data_parallelism(optimizer: str, micro_batches: int) -> None:
    """Every level takes bit for bit the steps of plain data parallelism (2 copies: sums of two are exact)."""
    results = run_ranks(every_level, 2, optimizer, micro_batches, timeout=180)
    for result in results:
        for level in LEVELS:
            assert result[level]["losses"] == result["plain"]["losses"], level
            for key, value in result["plain"]["state"].items():
                assert torch.equal(result[level]["state"][key], value), (level, key)


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_per_rank_follow_the_zero_formula(world: int) -> None:
    """fp64 Adam, Ψ elements: v0 8Ψ+8Ψ+16Ψ/N, v1 8Ψ+24Ψ/N, v2 32Ψ/N bytes per rank, N = world.

    Exactly: each rank holds the partition it owns (whole parameters, balanced), and the
    partitions add up to the whole model.
    """
    results = run_ranks(every_level, world, "adam", 1, timeout=240)
    whole = 8 * sum(p.numel() for p in build().parameters())
    largest = 8 * 40 * 12
    for level in LEVELS:
        owned = [r[level]["owned_bytes"] for r in results]
        assert sum(owned) == whole, level
        for result, mine in zip(results, owned, strict=True):
            assert mine <= whole / world + largest, (level, mine)
            expected = {
                "v0": (whole, whole, 2 * mine),
                "v1": (whole, mine, 2 * mine),
                "v2": (mine, mine, 2 * mine),
            }[level]
            assert result[level]["bytes"] == expected, (level, result["rank"])
            assert result["plain"]["bytes"] == (whole, whole, 2 * whole)
            assert result[level]["losses"] == pytest.approx(result["plain"]["losses"], rel=1e-12, abs=0)
            for key, value in result["plain"]["state"].items():
                torch.testing.assert_close(result[level]["state"][key], value, rtol=1e-12, atol=1e-12)


def test_partition_is_balanced_and_deterministic() -> None:
    params = [nn.Parameter(torch.empty(n)) for n in (480, 40, 280, 7, 21, 3)]
    parts = balanced_partition(params, 2)
    assert [sum(p.numel() for p in part) for part in parts] == [480, 351]
    assert balanced_partition(params, 2) == parts
    assert sorted(id(p) for part in balanced_partition(params, 4) for p in part) == sorted(id(p) for p in params)
