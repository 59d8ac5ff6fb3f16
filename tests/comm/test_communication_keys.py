"""Every communication key of the manual has a visible effect, and training stays equal to its reference."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.comm.scenarios import check, train_on_ranks
from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.multiprocess

F32, F64 = torch.float32, torch.float64
#: Scenarios that count what crosses the reducer's communicators: the gradients only, without the step check's
#: gather of step numbers (communication.check_steps, tested in test_step_check.py).
GRADIENTS_ONLY = {"communication.check_steps": False}
SCENARIOS: dict[str, dict[str, Any]] = {
    "one_bucket": {"optimizer": "adam", "dtype": F64, "config": {"communication.max_splits": 1}},
    "three_buckets": {"optimizer": "adam", "dtype": F64, "config": {"communication.max_splits": 3}},
    # 3,480 bytes of float64 gradients in one bucket would exceed 0.001 MiB (1,048 bytes): cut into 3 within it
    "byte_bound": {
        "optimizer": "adam",
        "dtype": F64,
        "config": {"communication.max_splits": 1, "communication.bucket_size_mb": 0.001},
    },
    "three_communicators": {
        "optimizer": "adam",
        "dtype": F64,
        "config": {"communication.max_splits": 5, "communication.num_communicators": 3},
    },
    "fp32_wire": {"optimizer": "sgd", "dtype": F32, "config": GRADIENTS_ONLY},
    "fp16_wire": {"optimizer": "sgd", "dtype": F32, "config": {"communication.fp16": True, **GRADIENTS_ONLY}},
    "sparse": {"optimizer": "plain_sgd", "dtype": F64, "model": "embedding", "config": GRADIENTS_ONLY},
    "sparse_as_dense": {
        "optimizer": "plain_sgd",
        "dtype": F64,
        "model": "embedding",
        "config": {"communication.sparse_as_dense": True, **GRADIENTS_ONLY},
    },
    "clip_before_allreduce": {
        "optimizer": "plain_sgd",
        "dtype": F64,
        "config": {"optimizer.max_grad_norm": 0.05},
        "reference": "clip_per_replica",
    },
    "clip_after_allreduce": {
        "optimizer": "plain_sgd",
        "dtype": F64,
        "config": {"optimizer.max_grad_norm": 0.05, "communication.clip_after_allreduce": True},
    },
    "probe_backward": {"optimizer": "adam", "dtype": F64, "probe": True},
    "sum": {
        "optimizer": "plain_sgd",
        "dtype": F64,
        "config": {"communication.gradients_reduce_method": "sum"},
        "reference_optimizer": "plain_sgd_x2",  # the sum of 2 replicas' mean gradients is twice their mean
    },
}
NAMES = list(SCENARIOS)
_ranks: list[list[dict[str, Any]]] = []


def outcome(name: str) -> list[dict[str, Any]]:
    """Each rank's result for scenario ``name`` (all scenarios run in one 2-process job)."""
    if not _ranks:
        _ranks.extend(run_ranks(train_on_ranks, 2, [SCENARIOS[n] for n in NAMES], timeout=300))
    return [rank_results[NAMES.index(name)] for rank_results in _ranks]


def equal_to_reference(name: str, rtol: float | None = None) -> None:
    check([SCENARIOS[name]], [[result] for result in outcome(name)], rtol=rtol)


def test_max_splits_sets_the_number_of_buckets() -> None:
    assert {r["buckets"] for r in outcome("one_bucket")} == {1}
    assert {r["buckets"] for r in outcome("three_buckets")} == {3}
    equal_to_reference("one_bucket")
    equal_to_reference("three_buckets")


def test_bucket_size_mb_bounds_each_bucket_where_max_splits_would_exceed_it() -> None:
    assert {r["buckets"] for r in outcome("byte_bound")} == {3}
    equal_to_reference("byte_bound")


def test_num_communicators_spreads_buckets_round_robin() -> None:
    (first, second) = outcome("three_communicators")
    assert first["buckets"] == 5 and first["bucket_communicators"] == 3 == second["bucket_communicators"]
    equal_to_reference("three_communicators")


def test_fp16_halves_the_bytes_on_the_wire_within_tolerance() -> None:
    fp32 = outcome("fp32_wire")[0]["bytes_per_step"]
    fp16 = outcome("fp16_wire")[0]["bytes_per_step"]
    assert fp16 == fp32 / 2
    equal_to_reference("fp16_wire", rtol=2e-3)


def test_sparse_gradients_travel_as_indices_and_values() -> None:
    sparse, dense = outcome("sparse"), outcome("sparse_as_dense")
    assert "all_gather" in sparse[0]["ops"]
    assert dense[0]["ops"] == ["all_reduce"]
    equal_to_reference("sparse")
    equal_to_reference("sparse_as_dense")


def test_clip_order() -> None:
    equal_to_reference("clip_before_allreduce")
    equal_to_reference("clip_after_allreduce")
    before = outcome("clip_before_allreduce")[0]["params"]
    after = outcome("clip_after_allreduce")[0]["params"]
    assert any(not torch.allclose(b, a) for b, a in zip(before, after, strict=True))


def test_sum_reduces_without_dividing() -> None:
    equal_to_reference("sum")


def test_a_backward_outside_engine_step_does_not_leak_into_the_next_step() -> None:
    equal_to_reference("probe_backward")
