"""``epl plan --auto``: every layout EPL can run for a model on a cluster, estimated, best first.

Searched: tensor degrees that divide the heads and fit in a node, pipeline degrees up to the layers (uneven stages
as the automatic partition makes them: the most loaded holds ``ceil(L/p)`` blocks), data parallelism for the rest;
micro-batch sizes dividing each replica's batch; ZeRO none, v0, v1, v2; checkpointing none, auto (selective: EPL's
``gradient_checkpoint.type: "selective"``) and full (EPL's ``"auto"``, each block from its input); sequence
parallelism on and off under
tensor parallelism; context parallelism (``context.degree``) with any of them (each lane of ``t x p`` devices on
``s/c`` tokens); 1F1B,
interleaved (2 chunks per device) and ZeroBubble pipelines. A plan that does not fit ranks after every plan that
does; among those that fit, the shortest predicted step wins.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from epl.planner.devices import DeviceProfile
from epl.planner.estimate import Estimate, estimate
from epl.planner.layout import SEARCHED_CHECKPOINTING, Layout, Schedule, Workload, ZeroLevel
from epl.planner.shape import ModelShape


@dataclass(frozen=True)
class SearchResult:
    """The plans, best first, how many layouts were estimated and how long it took."""

    plans: tuple[Estimate, ...]
    searched: int
    search_seconds: float


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _context_degrees(world_size: int, tensor: int, workload: Workload) -> list[int]:
    """Every context degree left by ``tensor`` that cuts each sequence into ``2c`` equal chunks (1 included)."""
    return [c for c in _divisors(world_size // tensor) if c == 1 or workload.sequence % (2 * c) == 0]


def layouts(shape: ModelShape, workload: Workload, world_size: int) -> list[Layout]:
    """Every layout :mod:`this module's <epl.planner.search>` search considers."""
    found = []
    for t in _divisors(world_size):
        if t > workload.devices_per_node or shape.heads % t or shape.kv_heads % t and t % shape.kv_heads:
            continue
        for c in _context_degrees(world_size, t, workload):
            # split.sequence_parallel shares each device's tokens among the tensor devices
            sequence_choices = (False, True) if t > 1 and (workload.sequence // c) % t == 0 else (False,)
            for p in _divisors(world_size // (t * c)):
                if p > shape.layers:
                    continue
                d = world_size // (t * p * c)
                if workload.global_batch % d:
                    continue
                replica_batch = workload.global_batch // d
                for b in _divisors(replica_batch):
                    if b > 16:
                        break
                    m = replica_batch // b
                    if p > 1 and m < p:
                        continue
                    schedules: tuple[Schedule, ...] = ("1F1B", "interleaved", "ZeroBubble") if p > 1 else ("1F1B",)
                    for schedule in schedules:
                        virtual = 2 if schedule == "interleaved" else 1
                        if shape.layers < p * virtual:
                            continue
                        zeros: tuple[ZeroLevel, ...] = ("none", "v0", "v1", "v2") if d * c > 1 else ("none",)
                        for zero in zeros:
                            for checkpoint in SEARCHED_CHECKPOINTING:
                                for sequence_parallel in sequence_choices:
                                    found.append(Layout(d, t, p, m, b, zero, checkpoint, schedule, virtual,
                                                        sequence_parallel=sequence_parallel, context=c))  # fmt: skip
    return found


def search(shape: ModelShape, workload: Workload, device: DeviceProfile, world_size: int) -> SearchResult:
    """Estimate every layout and rank them: those that fit first, then by predicted step time."""
    start = time.perf_counter()
    estimates = [estimate(shape, layout, workload, device) for layout in layouts(shape, workload, world_size)]
    estimates.sort(key=lambda e: (not e.fits, e.step_time_s, e.peak))
    return SearchResult(tuple(estimates), len(estimates), time.perf_counter() - start)
