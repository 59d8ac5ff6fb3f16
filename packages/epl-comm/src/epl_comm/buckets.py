"""Gradient fusion: which parameters' gradients travel together, and in which order.

Parameters are taken in reverse creation order (the order backward produces their
gradients), grouped by dtype, and each dtype group is cut into ``communication.max_splits``
contiguous buckets of about equal bytes (fewer when it has fewer parameters), or more where those would exceed
``communication.bucket_size_mb``: then into as many as keep each within it (as torch DDP's ``bucket_cap_mb``; a
tensor larger than it is a bucket of its own). So the manual's count holds for every model up to
``max_splits x bucket_size_mb`` of gradients per dtype, and no bucket of a larger one is larger than the bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn


def plan_buckets(
    params: Sequence[nn.Parameter], max_splits: int, bucket_bytes: float = math.inf
) -> list[list[nn.Parameter]]:
    """The buckets of ``params`` (given in creation order), in the order they are reduced: ``max_splits`` per dtype,
    or more where one would hold more than ``bucket_bytes``."""
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for param in reversed(params):
        by_dtype.setdefault(param.dtype, []).append(param)
    buckets: list[list[nn.Parameter]] = []
    for group in by_dtype.values():
        balanced = _balanced_cuts(group, max_splits)
        if all(_bytes(bucket) <= bucket_bytes for bucket in balanced):
            buckets += balanced
        else:
            buckets += _capped_cuts(group, bucket_bytes)
    return buckets


def _bytes(params: Sequence[nn.Parameter]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _capped_cuts(params: list[nn.Parameter], cap: float) -> list[list[nn.Parameter]]:
    """Cut ``params`` into contiguous runs of at most ``cap`` bytes each (a larger tensor alone), filled in order."""
    cuts: list[list[nn.Parameter]] = [[]]
    filled = 0
    for param in params:
        size = param.numel() * param.element_size()
        if cuts[-1] and filled + size > cap:
            cuts.append([])
            filled = 0
        cuts[-1].append(param)
        filled += size
    return cuts


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
