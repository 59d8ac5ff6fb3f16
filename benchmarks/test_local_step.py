"""Overhead of the local ``engine.step`` against the plain PyTorch training loop (target: within 3%)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import epl
from benchmarks.harness import ResultRow, Section, compare, record, short_mode

WIDTH, BATCH = 512, 64
#: CI (short mode) only catches gross regressions; a full run checks the target with margin for noise.
MAX_RATIO = 1.5 if short_mode() else 1.08
SECTION = Section(
    "Local step",
    __file__,
    "Time of EPL's `engine.step` on one process over the plain PyTorch loop (zero_grad, forward, loss, "
    "backward, step; with micro-batches, gradient accumulation) training the engine's own model and "
    "optimizer: a 512-wide 3-layer MLP, batch 64, Adam, one thread. Both return the step's loss (with "
    "micro-batches the mean of their losses, detached), as a training loop that reports it does. The ratio "
    "is EPL's own overhead; target <= 1.03.",
)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 10))


LOSS = nn.CrossEntropyLoss()


def plain_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, micro: int
) -> torch.Tensor:
    """One step of the loop a user writes without EPL (gradient accumulation by hand with micro-batches); it
    returns what ``engine.step`` returns: the loss, or the mean of the micro-batch losses, detached. (Keeping
    the micro-batch losses and averaging them costs little, but moves the step's small allocations: in one
    process or another the loop that does it runs up to 3% slower or faster than one that does not, EPL's
    step included, which then measured that instead of EPL's own overhead.)"""
    loss_fn = LOSS
    opt.zero_grad()
    if micro == 1:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()
    losses = []
    for xm, ym in zip(x.chunk(micro), y.chunk(micro), strict=True):
        loss = loss_fn(model(xm), ym)
        (loss / micro).backward()
        losses.append(loss.detach())
    opt.step()
    return torch.stack(losses).mean()


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_local_engine_step_overhead(benchmark, micro_batches: int) -> None:
    torch.set_num_threads(1)
    x, y = torch.randn(BATCH, WIDTH), torch.randint(0, 10, (BATCH,))
    epl.init(epl.Config({"pipeline.num_micro_batch": micro_batches}))
    engine = epl.parallelize(make_model(), optimizer=lambda p: torch.optim.Adam(p, lr=1e-3), loss_fn=LOSS)

    # The plain loop trains the engine's own model and optimizer: same tensors, same memory,
    # so the ratio measures only what EPL's step adds.
    model, opt = engine.model, engine.optimizer
    result = compare(
        f"local_step_m{micro_batches}",
        lambda: plain_step(model, opt, x, y, micro_batches),
        lambda: engine.step(x, y),
        rounds=5 if short_mode() else 40,
        calls_per_round=5 if short_mode() else 20,
    )
    micro = f"{micro_batches} micro-batch{'es' if micro_batches > 1 else ''}"
    row = ResultRow(
        f"Local `engine.step`, {micro}",
        "plain PyTorch loop (same model and optimizer)",
        plot=f"local step, {micro}, vs plain loop",
    )
    record(f"local_step_m{micro_batches}", [result.row(row)], section=SECTION, details=[f"{micro}: {result.detail()}"])
    benchmark.extra_info.update(pytorch_ms=result.baseline_s * 1e3, epl_ms=result.epl_s * 1e3, ratio=result.ratio)
    benchmark.pedantic(engine.step, args=(x, y), rounds=3 if short_mode() else 20, iterations=1)
    assert result.ratio < MAX_RATIO, result.line()
