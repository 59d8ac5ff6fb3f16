"""PEFT's LoRA under the layouts :mod:`tests.models.test_peft` leaves out: data parallelism, ZeRO v0 and v1 over 2
replicas, and a pipeline cut at ``pipeline.split_points`` named under PEFT's wrappers; each equal to one process
(the same reference, tolerance and checks: no frozen parameter holds a gradient or optimizer state)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.distributed import run_ranks
from tests.models.test_peft import MICRO, assert_equal_to_local, train

pytestmark = pytest.mark.multiprocess


def replicas(zero: str) -> dict[str, Any]:
    return train({"zero.level": zero} if zero else {}, replicas=2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero", ["", "v0", "v1"], ids=["data parallel", "ZeRO v0", "ZeRO v1"])
def test_replicas_of_a_peft_model_equal_one_process(zero: str) -> None:
    assert_equal_to_local(run_ranks(replicas, 2, zero, timeout=240), 1, replicas=2)


def split_points() -> dict[str, Any]:
    config = {"pipeline.split_points": ["base_model.model.model.layers.1"], "pipeline.num_micro_batch": MICRO}
    return train(config)


@pytest.mark.timeout(300)
def test_a_pipeline_cut_at_named_points_of_a_peft_model_equals_one_process() -> None:
    """The stages are named under the wrappers' prefix (``base_model.model.``), as docs/finetuning.md shows."""
    assert_equal_to_local(run_ranks(split_points, 2, timeout=240), MICRO)
