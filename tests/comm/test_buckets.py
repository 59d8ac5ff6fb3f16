"""Gradient fusion: reverse order, grouped by dtype, at most max_splits byte-balanced buckets."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from epl_comm.buckets import plan_buckets


def params(*sizes: int, dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(n, dtype=dtype)) for n in sizes]


@pytest.mark.parametrize("max_splits", [1, 2, 3, 5, 8, 50])
def test_bucket_count_order_and_coverage(max_splits: int) -> None:
    ps = params(10, 10, 10, 1000, 10, 10, 2000, 5)
    buckets = plan_buckets(ps, max_splits)
    assert len(buckets) == min(max_splits, len(ps))
    assert all(buckets)
    assert [p for bucket in buckets for p in bucket] == list(reversed(ps))  # reverse creation order, contiguous


def test_buckets_are_byte_balanced() -> None:
    ps = params(*([100] * 12))
    assert [len(b) for b in plan_buckets(ps, 4)] == [3, 3, 3, 3]


def test_dtypes_never_share_a_bucket() -> None:
    floats, doubles = params(4, 4), params(4, 4, dtype=torch.float64)
    mixed = [floats[0], doubles[0], floats[1], doubles[1]]
    buckets = plan_buckets(mixed, 1)
    assert [{p.dtype for p in b} for b in buckets] == [{torch.float64}, {torch.float32}]


def test_buckets_stay_within_the_byte_bound_where_max_splits_would_exceed_it() -> None:
    """communication.bucket_size_mb: 12 tensors of 400 bytes in 5 buckets would hold up to 1,200 bytes each; with a
    bound of 1,000 they are cut into runs of 2 (800 bytes), and a tensor larger than the bound is a bucket alone."""
    ps = params(*([100] * 12))
    assert [len(b) for b in plan_buckets(ps, 5, bucket_bytes=1000)] == [2] * 6
    assert [len(b) for b in plan_buckets(ps, 5, bucket_bytes=2000)] == [3, 2, 3, 2, 2]  # max_splits' count holds
    big = params(10, 1000, 10)
    assert [[p.numel() for p in b] for b in plan_buckets(big, 1, bucket_bytes=100)] == [[10], [1000], [10]]
