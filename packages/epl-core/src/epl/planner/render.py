"""The planner's estimates as text for ``epl plan``: one plan, or ``--auto``'s best plans and why the others lost."""

from __future__ import annotations

from epl.placement.render import format_bytes
from epl.planner.devices import DeviceProfile
from epl.planner.estimate import ALLOCATOR_RESERVE, MFU_FORMULA, RESERVED_BYTES, Estimate, reserved_bytes
from epl.planner.layout import Layout, Workload
from epl.planner.memory import TERM_MEANINGS
from epl.planner.search import SearchResult


def describe_layout(layout: Layout) -> str:
    """``data 32 x tensor 8 x pipeline 4, 16 micro-batches of 1, ZeRO v1, checkpointing none, 1F1B``."""
    schedule = layout.schedule + (f" ({layout.virtual_stages} chunks)" if layout.schedule == "interleaved" else "")
    return (
        f"data {layout.data} x tensor {layout.tensor} x pipeline {layout.pipeline}, {layout.micro_batches} "
        f"micro-batch(es) of {layout.micro_batch_size}, ZeRO {layout.zero}, checkpointing "
        f"{layout.gradient_checkpoint}"
        + (f", {schedule}" if layout.pipeline > 1 else "")
        + (", sequence parallel" if layout.sequence_parallel else "")
        + (f", context {layout.context}" if layout.context > 1 else "")
    )


def describe(result: Estimate, device: DeviceProfile) -> str:
    """The estimate's lines: layout, the peak memory of the most loaded device term by term (they add up to the
    peak), step time and its parts, tokens/s, MFU."""
    parts = ", ".join(f"{name.replace('_', ' ')} {seconds:.3g} s" for name, seconds in result.time_parts.items())
    fits = "fits" if result.fits else "DOES NOT FIT"
    memory = result.memory
    stage = f"stage {memory.stage}, " if result.layout.pipeline > 1 else ""
    return "\n".join(
        [
            f"  layout: {describe_layout(result.layout)}",
            f"  peak memory per device {format_bytes(int(result.peak))} ({stage}{memory.moment}) of "
            f"{format_bytes(device.memory_bytes)}, {format_bytes(RESERVED_BYTES)} kept for the runtime: {fits}; the "
            f"allocator reserves about {format_bytes(int(reserved_bytes(result.peak)))} for it "
            f"({ALLOCATOR_RESERVE:.0%} over, typical)",
            *(
                f"    {name.replace('_', ' ')} {format_bytes(int(size))}: {TERM_MEANINGS[name]}"
                for name, size in memory.terms.items()
            ),
            f"  step time {result.step_time_s:.3g} s: {parts}",
            f"  {result.tokens_per_second:,.0f} tokens/s, MFU {100 * result.mfu:.1f}%",
            *(f"  note: {note}" for note in result.notes),
        ]
    )


def heading(device: DeviceProfile, workload: Workload, devices: int) -> str:
    """What the estimates assume."""
    return (
        f"Estimate on {devices} x {device.name} (global batch {workload.global_batch} x sequence {workload.sequence}, "
        f"{workload.dtype}{' autocast over float32 weights' if workload.autocast else ''}, "
        f"{workload.devices_per_node} devices per node, GEMM efficiency {device.efficiency:.0%}); "
        f"{MFU_FORMULA}"
    )


def describe_search(result: SearchResult, device: DeviceProfile, runners_up: int = 5) -> str:
    """The best plan with what to paste, then the runners-up and why each lost."""
    if not result.plans:
        return "No layout divides the cluster, the batch and the model: change the global batch or the world size."
    best = result.plans[0]
    lines = [f"Searched {result.searched} layouts in {result.search_seconds:.2f} s. Best:", describe(best, device)]
    lines += [f"  annotation: {best.layout.annotation()}", f"  epl.Config({best.layout.config()!r})"]
    if runners_up and len(result.plans) > 1:
        lines.append("Runners-up (the best of each other layout; ZeRO levels alone are not listed):")
        seen = {_shape_of(best.layout)}
        others = []
        for other in result.plans[1:]:
            if _shape_of(other.layout) not in seen:
                seen.add(_shape_of(other.layout))
                others.append(other)
            if len(others) == runners_up:
                break
        for other in others:
            if not other.fits:
                why = f"does not fit ({format_bytes(int(other.peak))})"
            else:
                why = f"slower by {100 * (other.step_time_s / best.step_time_s - 1):.1f}%"
            lines.append(f"  {describe_layout(other.layout)}: {why}")
    return "\n".join(lines)


def _shape_of(layout: Layout) -> tuple[object, ...]:
    """A layout without its ZeRO level: runners-up differing only in it are left out."""
    return (layout.data, layout.tensor, layout.pipeline, layout.micro_batches, layout.micro_batch_size,
            layout.gradient_checkpoint, layout.schedule, layout.virtual_stages, layout.sequence_parallel,
            layout.context)  # fmt: skip
