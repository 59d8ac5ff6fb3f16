"""Gradient fusion: which parameters' gradients travel together, and in which order.

Parameters are taken in reverse creation order (the order backward produces their
gradients), grouped by dtype, and each dtype group is cut into at most
``communication.max_splits`` contiguous buckets of about equal bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def plan_buckets(params: Sequence[nn.Parameter], max_splits: int) -> list[list[nn.Parameter]]:
    """The buckets of ``params`` (given in creation order), in the order they are reduced."""
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for param in reversed(params):
        by_dtype.setdefault(param.dtype, []).append(param)
    buckets: list[list[nn.Parameter]] = []
    for group in by_dtype.values():
        buckets += _balanced_cuts(group, max_splits)
    return buckets


def _balanced_cuts(params: list[nn.Parameter], parts: int) -> list[list[nn.Parameter]]:
    """Cut ``params`` into at most ``parts`` contiguous runs of about equal bytes (none empty)."""
    parts = min(parts, len(params))
    sizes = [p.numel() * p.element_size() for p in params]
    total = sum(sizes)
    cuts: list[list[nn.Parameter]] = [[] for _ in range(parts)]
    filled = 0
    for index, (param, size) in enumerate(zip(params, sizes, strict=True)):
        left_params = len(params) - index
        bucket = min(int(filled * parts / total) if total else 0, parts - 1)
        # never leave later buckets empty: the last left_params parameters fill the last buckets
        bucket = max(bucket, parts - left_params)
        # never skip a bucket: each bucket gets at least one parameter before the next starts
        first_empty = next((i for i, cut in enumerate(cuts) if not cut), parts)
        bucket = min(bucket, first_empty)
        cuts[bucket].append(param)
        filled += size
    return cuts
