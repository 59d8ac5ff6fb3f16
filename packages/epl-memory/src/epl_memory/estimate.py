"""ZeRO's part of ``epl plan``'s memory estimate: each rank keeps its partition of what ``zero.level`` splits.

The core estimates plain bytes per rank (every copy holds its parameters, gradients
and optimizer states whole). With ``zero.level``, the copies of every group of
tensors (the devices that hold the same tensors, :mod:`epl.placement.copies`) split
them into the balanced partition a run makes (:func:`epl_memory.zero.balanced_partition`
over the rank's parameters in model order, whole parameters to each owner), and a rank
keeps of each tensor with several copies only what it owns:

* ``v0``: optimizer states;
* ``v1``: optimizer states and gradients;
* ``v2``: optimizer states, gradients and parameters.

Tensors with one copy stay whole. For fp32 Adam over Ψ elements with N copies that is
4Ψ + 4Ψ + 8Ψ/N (v0), 4Ψ + 12Ψ/N (v1), 16Ψ/N (v2) bytes, up to the partition's imbalance,
which the estimate reproduces exactly rather than dividing by N.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from epl.plugin_api import EstimatedTensor, MemoryEstimate, MemoryEstimateContext

#: What each level partitions over the copies.
PARTITIONED = {
    "v0": ("optimizer states",),
    "v1": ("optimizer states", "gradients"),
    "v2": ("optimizer states", "gradients", "parameters"),
}


def adjust_for_zero(estimate: MemoryEstimate, context: MemoryEstimateContext) -> MemoryEstimate | None:
    """``estimate`` with only the rank's partition of what ``zero.level`` splits; None without ZeRO."""
    level = context.config["zero.level"]
    if level not in PARTITIONED or context.plan.local:  # one process: ZeRO does not apply
        return None
    owned = owned_tensors(context)
    split = PARTITIONED[level]
    states = [t.state_bytes for t in owned]
    copies = sorted({len(context.copies(t).devices) for t in context.tensors})
    return replace(
        estimate,
        parameter_bytes=sum(t.bytes for t in owned) if "parameters" in split else estimate.parameter_bytes,
        gradient_bytes=sum(t.gradient_bytes for t in owned) if "gradients" in split else estimate.gradient_bytes,
        optimizer_state_bytes=None if None in states else sum(s or 0 for s in states),
        notes=(
            *estimate.notes,
            f"ZeRO {level}: {', '.join(split)} partitioned over the copies of each tensor "
            f"({' or '.join(map(str, copies))} copies), whole tensors to each owner",
        ),
    )


def owned_tensors(context: MemoryEstimateContext) -> list[EstimatedTensor]:
    """The rank's tensors that it owns: its part of each group of copies, and every tensor with one copy."""
    groups: dict[tuple[int, ...], list[EstimatedTensor]] = {}
    for tensor in context.tensors:
        groups.setdefault(context.copies(tensor).devices, []).append(tensor)
    owned: list[EstimatedTensor] = []
    for devices, members in groups.items():
        if len(devices) == 1:
            owned += members
            continue
        parts = _partition(tuple(t.numel for t in members), len(devices))
        owned += [members[i] for i in parts[devices.index(context.rank)]]
    return owned


@functools.lru_cache(maxsize=256)
def _partition(numels: tuple[int, ...], parts: int) -> tuple[tuple[int, ...], ...]:
    """Indices of ``numels`` per part, as :func:`epl_memory.zero.balanced_partition` splits such tensors.

    Cached: every rank of a group of copies asks for the same partition.
    """
    import torch

    from epl_memory.zero import balanced_partition

    stand_ins = [torch.empty(n, device="meta") for n in numels]
    index = {id(t): i for i, t in enumerate(stand_ins)}
    return tuple(tuple(index[id(t)] for t in part) for part in balanced_partition(stand_ins, parts))
