"""docs/planner.md's tables of the published runs, from the rows and fits the tests check:
``python -m tests.planner.published_report``."""

from __future__ import annotations

import statistics

from epl.planner import Estimate, Layout, estimate
from tests.planner.published import FITTED_ON, MEMORY_RUNS, RUNS, PublishedRun, profile_for
from tests.planner.test_published import (
    errors,
    fitted_efficiency,
    memory_error,
    predicted_figure,
)

GIB = 2**30
UNITS = {
    "tflops": "TFLOP/s per GPU",
    "iteration_s": "s per iteration",
    "mfu": "MFU",
    "tokens_per_s": "tokens/s per GPU",
}


def short(layout: Layout) -> str:
    """``t8 p16 d64 c1, 32 x 1, ZeRO v1, recompute none, interleaved v8 N5, SP, stages 7/8/7``."""
    context = f" c{layout.context}" if layout.context > 1 else ""
    parts = [f"t{layout.tensor} p{layout.pipeline} d{layout.data}{context}",
             f"{layout.micro_batches} x {layout.micro_batch_size}", f"ZeRO {layout.zero}",
             f"recompute {layout.gradient_checkpoint}"]  # fmt: skip
    if layout.pipeline > 1:
        group = f" N{layout.interleave_group}" if layout.interleave_group else ""
        parts.append(
            f"interleaved v{layout.virtual_stages}{group}" if layout.schedule == "interleaved" else layout.schedule
        )
    if layout.sequence_parallel:
        parts.append("SP")
    if layout.stage_layers:
        parts.append("stages " + "/".join(str(n) for n in dict.fromkeys(layout.stage_layers)))
    return ", ".join(parts)


def memory_table() -> str:
    """One line per published memory figure: the planner's peak on the measured stage against it."""
    lines = ["| run | layout | measure | published | predicted | error |", "|---|---|---|---|---|---|"]
    for run in MEMORY_RUNS:
        predicted = predicted_figure(run) / GIB
        if run.published_gib is None:  # predicted_figure: what the device would need
            figure, error = "out of memory", f"{predicted:.1f} GiB > {run.device.memory_bytes / GIB:.1f}: agrees"
        else:
            figure, error = f"{run.published_gib:g} GiB", f"{100 * memory_error(run):+.1f}%"
        lines.append(f"| {run.name} | {short(run.layout)} | {run.measure} | {figure} | {predicted:.1f} GiB | {error} |")
    return "\n".join(lines)


def _figure(run: PublishedRun, value: float) -> str:
    if run.metric == "mfu":
        return f"{100 * value:.1f}%"
    return f"{value:,.2f}" if run.metric == "iteration_s" else f"{value:,.0f}"


def _estimate(run: PublishedRun) -> Estimate:
    return estimate(run.shape, run.layout, run.workload, profile_for(run, fitted_efficiency(run.group)))


def throughput_table() -> str:
    """One line per row: published and predicted figure, error, fitted or predicted, predicted peak and device."""
    found = errors()
    lines = [
        "| source | run | GPUs | layout | published | predicted | error | | predicted peak of |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in RUNS:
        result = _estimate(run)
        device = profile_for(run, 1.0)
        predicted = run.published * (1 + found[run.name])
        fitted = "fitted" if run.name in FITTED_ON[run.group] else "predicted"
        lines.append(
            f"| {run.group} | {run.name} | {run.devices:,} | {short(run.layout)} | "
            f"{_figure(run, run.published)} {UNITS[run.metric]} | {_figure(run, predicted)} | "
            f"{100 * found[run.name]:+.1f}% | {fitted} | {result.peak / GIB:.1f} of "
            f"{device.memory_bytes / GIB:.1f} GiB |"
        )
    return "\n".join(lines)


def summary() -> str:
    """The fitted efficiencies and the errors of the rows not fitted on."""
    found = errors()
    unfitted = [abs(found[run.name]) for run in RUNS if run.name not in FITTED_ON[run.group]]
    efficiencies = ", ".join(f"{group} {fitted_efficiency(group):.3f}" for group in FITTED_ON)
    return (
        f"Fitted efficiencies: {efficiencies}. The {len(unfitted)} predicted rows: median error "
        f"{100 * statistics.median(unfitted):.1f}%, maximum {100 * max(unfitted):.1f}%."
    )


if __name__ == "__main__":
    print(throughput_table())
    print()
    print(summary())
    print()
    print(memory_table())
