"""ZeRO v0/v1/v2 (on torch's FSDP2) trains exactly like plain data parallelism, chunks every tensor evenly, and
leaves every parameter readable."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
from torch import nn

import epl
from epl_memory.apply_groups import balanced_partition
from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.multiprocess

OPTIMIZERS = {
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
}
LEVELS = ("v0", "v1", "v2")


class Uneven(nn.Module):
    """Rows that do not divide: 40, 7 and 3 rows (3 over 4 copies: one holds none), and a one-element scale."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 7), nn.Tanh(), nn.Linear(7, 3))
        self.scale = nn.Parameter(torch.full((1,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale


def build() -> nn.Module:
    torch.manual_seed(0)
    return Uneven().double()


def batches(replicas: int, index: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    share = 16 // replicas
    rows = slice(share * index, share * (index + 1))
    data = []
    for _ in range(3):
        x = torch.randn(16, 12, generator=generator, dtype=torch.float64)
        y = torch.randn(16, 3, generator=generator, dtype=torch.float64)
        data.append((x[rows], y[rows]))
    return data


def train(optimizer: str, zero: str, micro_batches: int = 1) -> dict[str, Any]:
    epl.init(epl.Config({"zero.level": zero, "pipeline.num_micro_batch": micro_batches}))
    engine = epl.parallelize(build(), optimizer=OPTIMIZERS[optimizer], loss_fn=nn.MSELoss())
    scheduler = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5)
    losses = []
    reductions = 0
    for x, y in batches(engine.num_replicas, engine.replica_index):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            losses.append(float(engine.step(x, y)))
        reductions = sum(event.name.startswith("FSDP::post_backward_reduce") for event in profile.events())
        scheduler.step()
    report = engine.memory_report()
    return {
        "reductions": reductions,  # FSDP2's gradient reductions in the last step
        "losses": losses,
        "state": engine.state_dict(full=True)["model"],
        "bytes": (report.parameter_bytes, report.gradient_bytes, report.optimizer_state_bytes),
        "local rows": [tuple(p.shape) for p in engine.parameters()],
    }


def every_level(optimizer: str, micro_batches: int) -> dict[str, Any]:
    return {level or "plain": train(optimizer, level, micro_batches) for level in ("", *LEVELS)}


@pytest.mark.parametrize(("optimizer", "micro_batches"), [("adam", 1), ("adamw", 2), ("sgd", 1)])
def test_zero_equals_plain_data_parallelism(optimizer: str, micro_batches: int) -> None:
    """Every level takes bit for bit the steps of plain data parallelism (2 copies: sums of two are exact); with
    micro-batches each one's gradient is reduce-scattered and the chunks summed, so the sums come in another order."""
    results = run_ranks(every_level, 2, optimizer, micro_batches, timeout=180)
    tolerance = 0.0 if micro_batches == 1 else 1e-12
    for result in results:
        # v0 (only the optimizer state sharded) accumulates whole gradients and reduces each block once a step
        assert result["v0"]["reductions"] * micro_batches == result["v1"]["reductions"] > 0, result
        for level in LEVELS:
            assert result[level]["losses"] == pytest.approx(result["plain"]["losses"], rel=tolerance, abs=0), level
            for key, value in result["plain"]["state"].items():
                torch.testing.assert_close(result[level]["state"][key], value, rtol=tolerance, atol=tolerance)


def in_one_process() -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same steps in this process, float64: plain PyTorch over the whole batch."""
    model = build()
    optimizer = OPTIMIZERS["adamw"](model.parameters())
    losses = []
    for x, y in batches(1, 0):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return losses, model.state_dict()


def four_copies() -> dict[str, Any]:
    """v2 over 4 copies: 3 rows and 1 element chunked over 4 (some copies hold nothing), AdamW."""
    epl.init(epl.Config({"zero.level": "v2"}))
    engine = epl.parallelize(build(), optimizer=OPTIMIZERS["adamw"], loss_fn=nn.MSELoss())
    losses = [float(engine.step(x, y)) for x, y in batches(engine.num_replicas, engine.replica_index)]
    return {
        "losses": losses,
        "state": engine.state_dict(full=True)["model"],
        "local rows": {name: p.to_local().shape[0] for name, p in engine.model.named_parameters()},
    }


def test_every_tensor_is_chunked_evenly_and_trains_as_one_process() -> None:
    """torch.chunk's rows per copy (40 -> 10 each, 7 -> 2, 2, 2, 1, 3 -> 1, 1, 1, 0, 1 -> 1, 0, 0, 0), and the
    run equals one process over the whole batch (float64, the mean over 4 copies in another order)."""
    losses, state = in_one_process()
    results = run_ranks(four_copies, 4, timeout=180)
    rows = {name: [result["local rows"][name] for result in results] for name in results[0]["local rows"]}
    assert rows["body.0.weight"] == rows["body.0.bias"] == [10, 10, 10, 10]
    assert rows["body.2.weight"] == [2, 2, 2, 1] and rows["body.4.weight"] == [1, 1, 1, 0]
    assert rows["scale"] == [1, 0, 0, 0]  # the one-element scale: one copy holds it
    means = [sum(step) / len(results) for step in zip(*(result["losses"] for result in results), strict=True)]
    assert means == pytest.approx(losses, rel=1e-12)  # each replica's loss is of its rows
    for result in results:
        for key, value in state.items():
            torch.testing.assert_close(result["state"][key], value, rtol=1e-12, atol=1e-12)


def read_everything(level: str) -> dict[str, Any]:
    """Every way a script reads weights, after parallelize and after a step: nothing crashes or lies."""
    epl.init(epl.Config({"zero.level": level}))
    engine = epl.parallelize(build(), optimizer=OPTIMIZERS["adamw"], loss_fn=nn.MSELoss())
    seen: dict[str, Any] = {}
    for moment in ("after parallelize", "after a step"):
        if moment == "after a step":
            engine.step(*batches(engine.num_replicas, engine.replica_index)[0])
        local = list(engine.parameters())
        seen[moment] = {
            "std": [float(p.float().std()) if p.numel() > 1 else None for p in local],
            "numpy": [p.numpy().copy() for p in local],
            "clone": [p.clone() for p in local],
            "printed": all(str(p).startswith("tensor(") for p in local),
            "vector": nn.utils.parameters_to_vector(local).numel(),
            "held": sum(p.numel() for p in local),
        }
        with engine.full_parameters():
            seen[moment]["whole"] = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
        seen[moment]["full state"] = engine.state_dict(full=True)["model"]
        try:
            copy.deepcopy(engine.model)
            seen[moment]["deepcopy"] = "copied"
        except Exception as error:  # noqa: BLE001 - the test reads the message
            seen[moment]["deepcopy"] = f"{type(error).__name__}: {error}"
        buffer = io.StringIO()
        print(next(engine.model.parameters()), file=buffer)
    return seen


@pytest.mark.parametrize("level", LEVELS)
def test_every_parameter_reads_without_a_collective_and_full_parameters_gathers_them(level: str) -> None:
    """``engine.parameters()`` are this rank's chunks: numpy, std, clone, print and parameters_to_vector work on one
    rank alone; ``engine.full_parameters()`` shows the whole tensors (equal to the full state dict)."""
    results = run_ranks(read_everything, 2, level, timeout=180)
    whole = sum(p.numel() for p in build().parameters())
    for result in results:
        for moment in ("after parallelize", "after a step"):
            seen = result[moment]
            assert seen["printed"] and seen["vector"] == seen["held"] < whole
            for name, value in seen["whole"].items():
                assert torch.equal(value, seen["full state"][name]), (moment, name)
            assert "deepcopy" in seen["deepcopy"] or seen["deepcopy"] == "copied", seen["deepcopy"]
    assert sum(r["after a step"]["held"] for r in results) >= whole  # the chunks cover every tensor


def test_partition_for_apply_groups_is_balanced_and_deterministic() -> None:
    params = [nn.Parameter(torch.empty(n)) for n in (480, 40, 280, 7, 21, 3)]
    parts = balanced_partition(params, 2)
    assert [sum(p.numel() for p in part) for part in parts] == [480, 351]
    assert balanced_partition(params, 2) == parts
    assert sorted(id(p) for part in balanced_partition(params, 4) for p in part) == sorted(id(p) for p in params)
