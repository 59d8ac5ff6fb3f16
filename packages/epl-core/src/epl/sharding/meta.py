"""Copies of modules on the ``meta`` device: their shapes, dtypes and attributes, no memory."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import torch
from torch import nn


def meta_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose parameters and buffers live on the ``meta`` device (nothing allocated).

    The split rules build ``epl plan``'s shards from such copies; a pipeline stage that runs on another rank
    answers the attributes the model's code reads of it (``embed_tokens.weight.dtype``) from one.
    """
    memo: dict[int, Any] = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = (
            nn.Parameter(meta, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
        )
    return copy.deepcopy(module, memo)
