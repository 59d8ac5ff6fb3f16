"""ZeRO's part of ``epl plan``'s memory estimate: each copy keeps an even chunk of every tensor with copies.

The core estimates plain bytes per rank (every copy holds its parameters, gradients and optimizer states whole).
With ``zero.level`` on several processes, each tensor with N copies (the devices that hold the same tensor,
:mod:`epl.placement.copies`) is chunked over them as FSDP2 chunks its rows (:mod:`epl_memory.zero`): the member at
position i of N holds rows ``[i * c, (i + 1) * c)`` of it, ``c = ceil(rows / N)`` (torch.chunk's rule; the last
positions hold fewer rows, or none). FSDP2 pads every position's parameter chunk, and the gradient chunk it
reduce-scatters into, to ``c`` rows; the optimizer's state is shaped like the chunk itself. Between steps every
level holds only these (v0 and v1 gather a block's weights for the step and drop them after its backward); for
fp32 Adam over Ψ elements that is about 16Ψ/N bytes. Tensors with one copy stay whole, and so do
those ZeRO keeps whole for a reason of its own (see :mod:`epl_memory.zero`), which the estimate does not model.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from epl.plugin_api import MemoryEstimate, MemoryEstimateContext

#: The levels ZeRO implements (all chunk parameters, gradients and optimizer states between steps).
LEVELS = ("v0", "v1", "v2")


def adjust_for_zero(estimate: MemoryEstimate, context: MemoryEstimateContext) -> MemoryEstimate | None:
    """``estimate`` with this rank's chunk of each tensor with several copies; None without ZeRO."""
    from epl_memory.settings import MemorySettings

    level = MemorySettings.from_config(context.config).zero.level
    if level not in LEVELS or context.plan.local:  # one process: ZeRO does not apply
        return None
    parameters = gradients = states = 0
    unknown = False
    counts = set()
    for tensor in context.tensors:
        devices = context.copies(tensor).devices
        counts.add(len(devices))
        padded, held = chunk_rows(tensor.rows, len(devices), devices.index(context.rank))
        rows = max(tensor.rows, 1)
        parameters += tensor.bytes * padded // rows
        gradients += tensor.gradient_bytes * padded // rows
        if tensor.state_bytes is None:
            unknown = True
        else:
            states += tensor.state_bytes * held // rows
    return replace(
        estimate,
        parameter_bytes=parameters,
        gradient_bytes=gradients,
        optimizer_state_bytes=None if unknown else states,
        notes=(
            *estimate.notes,
            f"ZeRO {level}: parameters, gradients and optimizer states chunked evenly over the copies of each tensor "
            f"({' or '.join(map(str, sorted(counts)))} copies) between steps"
            + ("; in a step v2 gathers one block at a time, v0 and v1 every block" if level else ""),
        ),
    )


def chunk_rows(rows: int, copies: int, position: int) -> tuple[int, int]:
    """Rows of a tensor of ``rows`` rows that the member at ``position`` of ``copies`` keeps: its padded chunk's
    (what FSDP2 allocates for the parameter and its gradient) and its own (the optimizer's state)."""
    if copies < 2:
        return rows, rows
    chunk = -(-rows // copies)
    return chunk, max(0, min(chunk, rows - position * chunk))
