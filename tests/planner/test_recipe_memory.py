"""The planner against torchtitan's 3D recipe run on the CPU (torch's FSDP2, tensor parallelism with sequence
parallelism and pipelining, every block recomputed): CI's slice of benchmarks/recipe_memory.py, on 8 processes
(2 stages x 2 data x 2 tensor devices), every rank within 15% of the planner's peak for its stage under the 405B
row's settings (tests/planner/published.py)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.multiprocess


def test_torchtitans_recipe_is_predicted_within_15_percent() -> None:
    from benchmarks.planner_memory import TOLERANCE
    from benchmarks.recipe_memory import NARROW, Run, measure, table

    records = measure("CI", Run(NARROW, 4, 1024, tensor=2))
    print(table(records))
    assert {r["stage"] for r in records} == {0, 1}
    for record in records:
        assert abs(record["error"]) <= TOLERANCE, table(records)
        assert "receive_buffers" in record["terms"]
    assert all("returned_outputs" in r["terms"] for r in records if r["stage"] == 1)
