"""docs/planner.md's tables of the published runs, from the rows and fits the tests check:
``python -m tests.planner.published_report``."""

from __future__ import annotations

import statistics

from epl.planner import Estimate, estimate
from epl.planner.render import describe_layout
from tests.planner.published import FITTED_ON, RUNS, PublishedRun, profile_for
from tests.planner.test_published import errors, fitted_efficiency

GIB = 2**30
UNITS = {
    "tflops": "TFLOP/s per GPU",
    "iteration_s": "s per iteration",
    "mfu": "MFU",
    "tokens_per_s": "tokens/s per GPU",
}


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
            f"| {run.group} | {run.name} | {run.devices:,} | {describe_layout(run.layout)} | "
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
