"""Data parallelism on real processes equals the local run on the same global batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.multiprocess

STEPS = 3
REPLICA_BATCH = 4
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
}


def build(dtype: torch.dtype) -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)).to(dtype)


def global_batches(replicas: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    size = replicas * REPLICA_BATCH
    return [
        (torch.randn(size, 6, generator=generator, dtype=dtype), torch.randn(size, 3, generator=generator, dtype=dtype))
        for _ in range(STEPS)
    ]


def local_run(scenario: dict[str, Any], replicas: int) -> tuple[list[float], list[torch.Tensor]]:
    """The same model trained in one process on the global batch: the reference."""
    dtype = scenario["dtype"]
    torch.manual_seed(0)
    model = build(dtype)
    optimizer = OPTIMIZERS[scenario["optimizer"]](model.parameters())
    micro = scenario.get("config", {}).get("pipeline.num_micro_batch", 1)
    max_norm = scenario.get("config", {}).get("optimizer.max_grad_norm")
    losses = []
    for x, y in global_batches(replicas, dtype):
        optimizer.zero_grad()
        parts = []
        for xm, ym in zip(x.chunk(micro), y.chunk(micro), strict=True):
            loss = nn.functional.mse_loss(model(xm), ym)
            (loss / micro).backward()
            parts.append(loss.detach())
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        losses.append(float(torch.stack(parts).mean()))
    return losses, [p.detach() for p in model.parameters()]


def train_on_ranks(scenarios: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """On every rank: train each scenario with EPL; report losses, parameters and wire bytes."""
    import torch.distributed as dist

    import epl

    results = []
    for scenario in scenarios:
        dtype = scenario["dtype"]
        epl.init(epl.Config(scenario.get("config", {})))
        torch.manual_seed(1000 * dist.get_rank() if dist.is_initialized() else 0)  # weights differ until broadcast
        if dist.is_initialized():
            torch.manual_seed(1000 * dist.get_rank())
        with epl.replicate(device_count=scenario.get("device_count", 1)):
            model = build(dtype)
        engine = epl.parallelize(model, optimizer=OPTIMIZERS[scenario["optimizer"]], loss_fn=nn.MSELoss())
        losses = []
        for x, y in global_batches(engine.num_replicas, dtype):
            share = slice(engine.replica_index * REPLICA_BATCH, (engine.replica_index + 1) * REPLICA_BATCH)
            losses.append(float(engine.step(x[share], y[share])))
        reducer = engine.context.gradient_reducer
        results.append(
            {
                "losses": losses,
                "params": [p.detach().clone() for p in engine.parameters()],
                "replica": engine.replica_index,
                "replicas": engine.num_replicas,
                "buckets": len(reducer.buckets) if reducer is not None else 0,
            }
        )
    return results


def check(scenarios: list[dict[str, Any]], ranks: list[list[dict[str, Any]]]) -> None:
    for index, scenario in enumerate(scenarios):
        per_rank = [rank_results[index] for rank_results in ranks]
        replicas = per_rank[0]["replicas"]
        expected_losses, expected_params = local_run(scenario, replicas)
        tolerance = (
            {"rtol": 1e-12, "atol": 1e-12} if scenario["dtype"] == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}
        )
        replica_losses = {r["replica"]: r["losses"] for r in per_rank}
        mean_losses = torch.tensor([replica_losses[i] for i in range(replicas)], dtype=torch.float64).mean(0)
        torch.testing.assert_close(mean_losses, torch.tensor(expected_losses, dtype=torch.float64), **tolerance)
        for result in per_rank:
            for ours, theirs in zip(result["params"], expected_params, strict=True):
                torch.testing.assert_close(ours, theirs, **tolerance, msg=lambda m, s=scenario: f"{s}: {m}")


EQUIVALENCE = [
    {"optimizer": name, "dtype": dtype, "config": {"pipeline.num_micro_batch": micro}}
    for name in OPTIMIZERS
    for dtype in (torch.float32, torch.float64)
    for micro in (1, 2)
]


def test_two_processes_equal_the_local_run_for_sgd_adam_adamw_with_and_without_accumulation() -> None:
    ranks = run_ranks(train_on_ranks, 2, EQUIVALENCE, timeout=240)
    check(EQUIVALENCE, ranks)


FOUR = [
    {"optimizer": "adam", "dtype": torch.float64, "config": {"pipeline.num_micro_batch": 2}},
    {"optimizer": "sgd", "dtype": torch.float32},
    # replicate(2) on 4 processes: 2 replicas, each replica batch split 2 ways
    {"optimizer": "adamw", "dtype": torch.float64, "device_count": 2},
]


def test_four_processes_and_replicate_two_split_the_replica_batch() -> None:
    ranks = run_ranks(train_on_ranks, 4, FOUR, timeout=240)
    check(FOUR, ranks)
    replicate_two = [rank_results[2] for rank_results in ranks]
    assert [r["replica"] for r in replicate_two] == [0, 0, 1, 1]
    # both ranks of a replica return the replica's mean loss
    assert replicate_two[0]["losses"] == replicate_two[1]["losses"]
