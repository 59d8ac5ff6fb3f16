"""The planner against published runs: fitted on at most 3 rows per source, it predicts the others' throughput
(median error <= 10%, at most 20%), every published layout fits, and its search finds a plan at least 0.95x as
fast as the published one (by its own prediction)."""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

from epl.planner import PROFILES, DeviceProfile, estimate, search
from tests.planner.published import FITTED_ON, RUNS, PublishedRun, megatron_flops


def predicted_tflops(run: PublishedRun, device: DeviceProfile) -> float:
    result = estimate(run.shape, run.layout, run.workload, device)
    return megatron_flops(run) / result.step_time_s / run.devices / 1e12


def fitted(device: str) -> DeviceProfile:
    """``device``'s profile with the efficiency that best predicts the rows it is fitted on (least log error)."""
    rows = [run for run in RUNS if run.name in FITTED_ON and run.device == device]

    def error(efficiency: float) -> float:
        profile = replace(PROFILES[device], efficiency=efficiency)
        return sum(math.log(predicted_tflops(run, profile) / run.tflops_per_device) ** 2 for run in rows)

    best = min((e / 1000 for e in range(300, 901)), key=error)
    return replace(PROFILES[device], efficiency=best)


def test_the_planner_predicts_the_published_throughput_it_was_not_fitted_on() -> None:
    device = fitted("a100-80gb")
    errors = {}
    for run in RUNS:
        result = estimate(run.shape, run.layout, run.workload, device)
        assert result.fits, f"{run.name}'s published layout is predicted not to fit ({result.peak / 2**30:.0f} GiB)"
        if run.name not in FITTED_ON:
            errors[run.name] = abs(predicted_tflops(run, device) / run.tflops_per_device - 1)
    assert statistics.median(errors.values()) <= 0.10, errors
    assert max(errors.values()) <= 0.20, errors


def test_the_search_finds_a_plan_as_fast_as_the_published_one() -> None:
    device = fitted("a100-80gb")
    for run in RUNS:
        published = estimate(run.shape, run.layout, run.workload, device)
        workload = replace(run.workload, devices_per_node=8)
        best = search(run.shape, workload, device, run.devices).plans[0]
        assert best.fits
        assert best.tokens_per_second >= 0.95 * published.tokens_per_second, (run.name, best.layout)
