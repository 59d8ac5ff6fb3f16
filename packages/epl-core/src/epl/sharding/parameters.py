"""Marking the parameters a split rule sharded, so data parallelism reduces them over the right copies."""

from __future__ import annotations

import torch
from torch import nn

_SHARDED = "_epl_sharded"


def sharded_parameter(values: torch.Tensor, like: nn.Parameter | None = None) -> nn.Parameter:
    """A new parameter holding ``values`` (a slice of ``like``), marked as one shard of a split tensor."""
    requires_grad = like.requires_grad if like is not None else True
    parameter = nn.Parameter(values.detach().clone(), requires_grad=requires_grad)
    setattr(parameter, _SHARDED, True)
    return parameter


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is one shard of a split tensor (each device holds a different part)."""
    return bool(getattr(tensor, _SHARDED, False))
