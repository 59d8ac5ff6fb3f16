"""Giving a tensor of the model values (or taking them back) without changing which Python object it is.

Every holder of a parameter (its modules, the TaskGraphs, the plugins' maps by ``id``) keeps seeing the same
object: ``torch.utils.swap_tensors`` exchanges what the object is. The object's attributes (a shard's spec)
and its gradient hooks are kept.
"""

from __future__ import annotations

import torch
from torch import nn

from epl.sharding.chunks import placed_like
from epl.sharding.data_shards import is_dtensor


def swap_values(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """Make ``tensor`` (the same object) hold ``value``'s data, device and dtype; ``value`` is left as it was. For a
    ``DTensor``, ``value`` is its local chunk; it stays a ``DTensor`` on the same mesh and placements."""
    data = value.detach()  # a new object on the same data
    if is_dtensor(tensor):
        new = _dtensor_like(tensor, data)
    elif isinstance(tensor, nn.Parameter):
        new = torch.Tensor._make_subclass(type(tensor), data, tensor.requires_grad)
    else:
        new = data
    new.__dict__.update(tensor.__dict__)
    hooks = list((getattr(tensor, "_backward_hooks", None) or {}).values())
    accumulate_hooks = list((getattr(tensor, "_post_accumulate_grad_hooks", None) or {}).values())
    torch.utils.swap_tensors(tensor, new)
    # The hook dictionaries come along as attributes, but autograd no longer calls them: set them anew.
    tensor._backward_hooks = None
    tensor._post_accumulate_grad_hooks = None  # type: ignore[assignment]  # torch's own "no hooks" (stub: a dict)
    for hook in hooks:
        tensor.register_hook(hook)
    for hook in accumulate_hooks:
        tensor.register_post_accumulate_grad_hook(hook)


def _dtensor_like(tensor: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A ``DTensor`` (a parameter when ``tensor`` is one) placed as ``tensor`` is, whose chunk on this device is
    ``local``."""
    placed = placed_like(local, tensor)
    return nn.Parameter(placed, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else placed


def to_meta(tensor: torch.Tensor) -> bool:
    """Give ``tensor``'s values back (it becomes a ``meta`` tensor of its shape); False when something else still
    holds a view of them (they stay)."""
    try:
        swap_values(tensor, torch.empty(tensor.shape, dtype=tensor.dtype, device="meta"))
    except RuntimeError:
        return False
    return True
