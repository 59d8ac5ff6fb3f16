"""Summary lines shared by the examples (kept out of the scripts so they show only the EPL parts).

The progress of each run is the library's ``epl.Progress``; ``summary`` prints the layout of
the run, the memory of every rank and the throughput. ``summary`` is a collective: every rank
calls it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

import epl
from epl.runtime.memory import MemoryReport


def is_rank0() -> bool:
    """Whether this process prints (rank 0 of the job, or the only process)."""
    return epl.Env.get().cluster.rank == 0


def say(*args: Any) -> None:
    """``print`` on rank 0 only."""
    if is_rank0():
        print(*args, flush=True)


def layout(engine: epl.Engine) -> list[str]:
    """The Plan in two lines: replicas, devices, stages; then which TaskGraphs each rank runs."""
    plan = engine.plan
    graphs = ", ".join(f"{tg.name} {tg.label}" for tg in plan.taskgraphs)
    if plan.local:
        return [f"1 process runs every TaskGraph ({graphs}); the annotations were checked, not applied"]
    replicas = f"{plan.num_replicas} replica{'s' if plan.num_replicas != 1 else ''}"
    head = f"{plan.world_size} processes = {replicas} x {plan.devices_per_replica} device(s)"
    if plan.num_stages > 1:
        strategy = epl.Env.get().config["pipeline.strategy"]
        head += f", a {plan.num_stages}-stage pipeline, {plan.num_micro_batch} micro-batches ({strategy})"
    elif plan.colocated:
        head += ", TaskGraphs colocated on the same devices"
    if plan.num_stages == 1 and plan.num_micro_batch > 1:
        head += f", {plan.num_micro_batch} micro-batches of gradient accumulation"
    ranks = []
    for rank in plan.devices_of_replica(0):
        held = plan.assignment(rank).taskgraphs
        parts = [
            f"{plan.taskgraphs[i].name} {plan.taskgraphs[i].label}"
            + (f"[shard {pos}]" if plan.taskgraphs[i].strategy == "split" else "")
            for i, pos in held
        ]
        ranks.append(f"rank {rank}: {' + '.join(parts)}")
    more = "; the other replicas alike" if plan.num_replicas > 1 else ""
    return [head, "; ".join(ranks) + more]


def memory_reports(engine: epl.Engine, batch: Sequence[Any] | None = None) -> list[MemoryReport]:
    """Every rank's ``engine.memory_report`` (with ``batch``: activations measured too). A collective."""
    env = epl.Env.get()
    report = engine.memory_report(*batch) if batch is not None else engine.memory_report()
    activations = -1 if report.activation_peak_bytes is None else report.activation_peak_bytes
    mine = torch.tensor(
        [report.parameter_bytes, report.gradient_bytes, report.optimizer_state_bytes, activations],
        dtype=torch.float64,
    )
    everyone = torch.empty(env.cluster.world_size * mine.numel(), dtype=torch.float64)
    env.communicator.all_gather(everyone, mine).wait()
    reports = []
    for rank, row in enumerate(everyone.view(env.cluster.world_size, -1).tolist()):
        params, grads, states, peak = (int(v) for v in row)
        reports.append(MemoryReport(rank, params, grads, states, None if peak < 0 else peak))
    return reports


def summary(
    name: str,
    engine: epl.Engine,
    progress: epl.Progress,
    *,
    batch: Sequence[Any] | None = None,
    extra: Sequence[str] = (),
) -> None:
    """Print the layout, the memory of every rank and the throughput (rank 0). Every rank calls it."""
    reports = memory_reports(engine, batch)
    if not is_rank0():
        return
    lines = [f"== {name} summary =="]
    lines += [f"layout:     {line}" for line in layout(engine)]
    lines += [f"memory:     {report}" for report in reports]
    lines += list(extra)
    progress.close()
    lines.append(
        f"throughput: {progress.samples_per_second or 0:.1f} samples/s (global batch {engine.last_step_samples}, "
        f"{engine.global_step} steps), final loss {progress.loss or float('nan'):.4f}"
    )
    print("\n".join(lines), flush=True)
