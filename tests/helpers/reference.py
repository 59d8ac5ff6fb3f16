"""The plain PyTorch loop that every parallel run is compared with, and the comparison of one rank's result."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn


def train_locally(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    micro_batches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = nn.functional.mse_loss,
    max_norm: float | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Per batch: gradients of ``loss_fn`` (MSE by default) accumulated over ``micro_batches`` equal chunks,
    clipped to ``max_norm`` if given, one optimizer step.

    Returns the mean micro-batch loss of every step and the final ``state_dict`` (cloned).
    """
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        parts = []
        for xm, ym in zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True):
            loss = loss_fn(model(xm), ym)
            (loss / micro_batches).backward()
            parts.append(loss.detach())
        if max_norm is not None:
            nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        losses.append(float(torch.stack(parts).mean()))
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def assert_rank_matches(
    result: Mapping[str, Any], losses: list[float], state: Mapping[str, torch.Tensor], tolerance: float
) -> None:
    """One rank's ``result["losses"]`` equal ``losses``, and every tensor of its ``result["state"]`` the same
    entry of ``state``, within ``tolerance`` (relative and absolute)."""
    torch.testing.assert_close(result["losses"], losses, rtol=tolerance, atol=tolerance)
    for name, value in result["state"].items():
        torch.testing.assert_close(value, state[name], rtol=tolerance, atol=tolerance, msg=name)


def pipeline_rank_result(engine: Any, losses: list[float], norms: list[float | None], **extra: Any) -> dict[str, Any]:
    """What one rank of a pipeline run reports for the comparison with the local run: its first stage, its replica,
    how many elements it holds, its losses and gradient norms, the whole model's state (a collective: every rank
    calls it), and ``extra``."""
    return {
        "stage": engine.context.pipeline.stages[0],
        "replica": engine.replica_index,
        "held": sum(p.numel() for p in engine.parameters()),
        "losses": losses,
        "norms": norms,
        "state": engine.state_dict(full=True)["model"],
        **extra,
    }
