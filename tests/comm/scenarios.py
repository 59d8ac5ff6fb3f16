"""Training scenarios run with EPL on real processes and, as the reference, in one local process.

A scenario is a dict: ``optimizer`` (a name of OPTIMIZERS), ``dtype``, optional
``config`` (EPL keys), ``device_count`` (of the replicate annotation), ``model``
("mlp" or "embedding", whose embedding has sparse gradients), ``reference``
("global": the local run on the global batch; "clip_per_replica": each replica's
gradients clipped before they are averaged, as the manual's default clip order)
``reference_optimizer`` (another optimizer for the local run) and ``probe`` (run a stray
backward outside ``engine.step`` before each step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

STEPS = 3
REPLICA_BATCH = 4
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "plain_sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "plain_sgd_x2": lambda p: torch.optim.SGD(p, lr=0.2),
}


class Bag(nn.Module):
    """Embedding (sparse gradients) -> mean over the sequence -> linear."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(20, 6, sparse=True)
        self.head = nn.Linear(6, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(tokens).mean(1))


def build(scenario: dict[str, Any]) -> nn.Module:
    if scenario.get("model") == "embedding":
        return Bag().to(scenario["dtype"])
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)).to(
        scenario["dtype"]
    )


def global_batches(scenario: dict[str, Any], replicas: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    size, dtype = replicas * REPLICA_BATCH, scenario["dtype"]
    batches = []
    for _ in range(STEPS):
        if scenario.get("model") == "embedding":
            x = torch.randint(0, 10, (size, 4), generator=generator)  # rows 10..19 are never used
        else:
            x = torch.randn(size, 6, generator=generator, dtype=dtype)
        batches.append((x, torch.randn(size, 3, generator=generator, dtype=dtype)))
    return batches


def local_run(scenario: dict[str, Any], replicas: int) -> tuple[list[float], list[torch.Tensor]]:
    """The same model trained in one process: the reference."""
    torch.manual_seed(0)
    model = build(scenario)
    optimizer = OPTIMIZERS[scenario.get("reference_optimizer", scenario["optimizer"])](model.parameters())
    config = scenario.get("config", {})
    micro = config.get("pipeline.num_micro_batch", 1)
    max_norm = config.get("optimizer.max_grad_norm")
    per_replica_clip = scenario.get("reference") == "clip_per_replica"
    losses = []
    for x, y in global_batches(scenario, replicas):
        optimizer.zero_grad()
        if per_replica_clip:
            losses.append(_clipped_replica_mean(model, x, y, replicas, max_norm))
        else:
            parts = []
            for xm, ym in zip(x.chunk(micro), y.chunk(micro), strict=True):
                loss = nn.functional.mse_loss(model(xm), ym)
                (loss / micro).backward()
                parts.append(loss.detach())
            if max_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            losses.append(float(torch.stack(parts).mean()))
        optimizer.step()
    return losses, [p.detach() for p in model.parameters()]


def _clipped_replica_mean(model: nn.Module, x: torch.Tensor, y: torch.Tensor, replicas: int, max_norm: float) -> float:
    grads: list[list[torch.Tensor]] = []
    losses = []
    for xr, yr in zip(x.chunk(replicas), y.chunk(replicas), strict=True):
        model.zero_grad()
        loss = nn.functional.mse_loss(model(xr), yr)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        grads.append([p.grad.clone() for p in model.parameters()])
        losses.append(float(loss.detach()))
    for param, *copies in zip(model.parameters(), *grads, strict=True):
        param.grad = torch.stack(copies).mean(0)
    return sum(losses) / replicas


def train_on_ranks(scenarios: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """On every rank: train each scenario with EPL; report losses, parameters and what went on the wire."""
    import torch.distributed as dist

    import epl

    results = []
    for scenario in scenarios:
        epl.init(epl.Config(scenario.get("config", {})))
        torch.manual_seed(1000 * dist.get_rank())  # weights differ on every rank until the broadcast
        with epl.replicate(device_count=scenario.get("device_count", 1)):
            model = build(scenario)
        engine = epl.parallelize(model, optimizer=OPTIMIZERS[scenario["optimizer"]], loss_fn=nn.MSELoss())
        reducer = engine.context.gradient_reducer
        sent_before = [c.log.bytes_sent for c in reducer.communicators] if reducer is not None else []
        seq_before = [c.log.seq for c in reducer.communicators] if reducer is not None else []
        losses = []
        for x, y in global_batches(scenario, engine.num_replicas):
            share = slice(engine.replica_index * REPLICA_BATCH, (engine.replica_index + 1) * REPLICA_BATCH)
            if scenario.get("probe"):  # a stray backward before the step must not leak into it
                engine.model(x[share]).sum().backward()
            losses.append(float(engine.step(x[share], y[share])))
        result: dict[str, Any] = {
            "losses": losses,
            "params": [p.detach().clone() for p in engine.parameters()],
            "replica": engine.replica_index,
            "replicas": engine.num_replicas,
        }
        if reducer is not None:
            result["buckets"] = len(reducer.buckets)
            result["bucket_communicators"] = len({id(b.communicator) for b in reducer.buckets})
            result["bytes_per_step"] = sum(
                c.log.bytes_sent - before for c, before in zip(reducer.communicators, sent_before, strict=True)
            ) / len(losses)
            result["ops"] = sorted(
                {
                    r.op
                    for c, before in zip(reducer.communicators, seq_before, strict=True)
                    for r in c.log.records
                    if r.seq > before
                }
            )
        results.append(result)
    return results


def check(scenarios: list[dict[str, Any]], ranks: list[list[dict[str, Any]]], rtol: float | None = None) -> None:
    """Losses (replica mean) and parameters of every rank equal the reference's."""
    for index, scenario in enumerate(scenarios):
        per_rank = [rank_results[index] for rank_results in ranks]
        replicas = per_rank[0]["replicas"]
        expected_losses, expected_params = local_run(scenario, replicas)
        if rtol is not None:
            tolerance = {"rtol": rtol, "atol": rtol}
        elif scenario["dtype"] == torch.float64:
            tolerance = {"rtol": 1e-12, "atol": 1e-12}
        else:
            tolerance = {"rtol": 1e-5, "atol": 1e-6}
        replica_losses = {r["replica"]: r["losses"] for r in per_rank}
        mean_losses = torch.tensor([replica_losses[i] for i in range(replicas)], dtype=torch.float64).mean(0)
        torch.testing.assert_close(mean_losses, torch.tensor(expected_losses, dtype=torch.float64), **tolerance)
        for result in per_rank:
            for ours, theirs in zip(result["params"], expected_params, strict=True):
                torch.testing.assert_close(ours, theirs, **tolerance, msg=lambda m, s=scenario: f"{s}: {m}")
