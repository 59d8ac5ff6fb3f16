"""A user's loss function over class-sharded logits: ``F.cross_entropy`` becomes the parallel cross-entropy.

When the model's output layer is split, its logits stay sharded by class (never
gathered) and the user's loss function runs under :class:`ShardedLogitsMode`. The
logits may go through what next-token losses do to them before the cross-entropy:

- indexing and slicing of any dimension but the last (``logits[:, :-1]``);
- ``flatten``/``view``/``reshape`` that keep the class dimension last (a whole class
  count in the new shape, as in ``view(-1, vocab_size)``, is read as this device's);
- casts and other operations that keep the shape (``float()``, ``contiguous()``);

and then ``F.cross_entropy`` (or ``nn.CrossEntropyLoss``) of 2-D logits without class
weights or label smoothing, which runs as :func:`~epl.sharding.cross_entropy.sharded_cross_entropy`.
Anything else a sharded tensor meets (``argmax`` for an accuracy, a softmax) gets the
whole logits, gathered once (correct, at the cost of one all-gather).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from epl.interfaces.shard_group import ShardGroup
from epl.sharding import collectives as C
from epl.sharding.cross_entropy import sharded_cross_entropy
from epl.sharding.dataflow import tensors_in

_MARK = "_epl_sharded_logits"
_SHAPES = {"view", "reshape", "flatten"}
_CROSS_ENTROPY = {F.cross_entropy}


def mark_sharded_logits(logits: torch.Tensor, group: ShardGroup, num_classes: int) -> torch.Tensor:
    """Mark ``logits`` (this device's classes, last dimension) as sharded over ``group`` out of ``num_classes``."""
    setattr(logits, _MARK, (group, num_classes))
    return logits


def same_marks(source: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """``result`` marked as ``source`` is, if it is (logits gathered along another dimension stay class-sharded)."""
    mark = _mark(source)
    return result if mark is None else mark_sharded_logits(result, *mark)


def _mark(tensor: torch.Tensor) -> tuple[ShardGroup, int] | None:
    return getattr(tensor, _MARK, None) if isinstance(tensor, torch.Tensor) else None


class ShardedLogitsMode(TorchFunctionMode):
    """Runs a loss function over marked, class-sharded logits (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.gathered: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        first = args[0] if args else kwargs.get("input")
        mark = _mark(first)
        if mark is not None and func in _CROSS_ENTROPY:
            result = self._cross_entropy(first, mark, args, kwargs)
            if result is not None:
                return result
        if mark is not None and not any(_mark(t) for t in list(tensors_in((args[1:], kwargs)))):
            kept = self._keeping_classes(func, first, mark, args, kwargs)
            if kept is not None:
                return kept
        if any(_mark(t) for t in tensors_in((args, kwargs))):
            args, kwargs = self._whole((args, kwargs))
        return func(*args, **kwargs)

    def _keeping_classes(
        self, func: Any, first: torch.Tensor, mark: tuple[ShardGroup, int], args: tuple[Any, ...], kwargs: Any
    ) -> torch.Tensor | None:
        """The result of an operation that keeps the class dimension last and whole, marked; else None."""
        name = getattr(func, "__name__", "")
        local = first.shape[-1]
        if name in ("view", "reshape") and len(args) > 1:
            shape = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple, torch.Size)) else args[1:]
            if shape and shape[-1] == mark[1]:
                shape = [*shape[:-1], local]  # the whole class count, read as this device's
            args = (first, tuple(shape))
        if name not in _SHAPES and name != "__getitem__" and not _same_shape_method(func, first, args):
            return None
        result = func(*args, **kwargs)
        if not isinstance(result, torch.Tensor) or result.dim() == 0 or result.shape[-1] != local:
            return None
        if name == "__getitem__" and not _keeps_last(args[1], first.dim()):
            return None
        if name == "flatten" and _flattens_last(args, kwargs, first.dim()):
            return None
        return mark_sharded_logits(result, *mark)

    def _cross_entropy(
        self, logits: torch.Tensor, mark: tuple[ShardGroup, int], args: tuple[Any, ...], kwargs: Any
    ) -> torch.Tensor | None:
        names = ["input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing"]
        given = {**dict(zip(names, args, strict=False)), **kwargs}
        if logits.dim() != 2 or given.get("weight") is not None or given.get("label_smoothing", 0.0):
            return None
        if given.get("size_average") is not None or given.get("reduce") is not None:
            return None
        group, classes = mark
        return sharded_cross_entropy(
            logits,
            given["target"],
            group,
            num_classes=classes,
            ignore_index=given.get("ignore_index", -100),
            reduction=given.get("reduction", "mean"),
        )

    def _whole(self, value: Any) -> Any:
        """``value`` with every marked tensor replaced by the whole logits (gathered once each)."""
        if isinstance(value, torch.Tensor):
            mark = _mark(value)
            if mark is None:
                return value
            if id(value) not in self.gathered:
                group, classes = mark
                whole = C.gather_from_shards(value, group, -1, group.sizes(classes))
                self.gathered[id(value)] = (value, whole)
            return self.gathered[id(value)][1]
        if isinstance(value, dict):
            return {key: self._whole(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._whole(item) for item in value)
        return value


def _same_shape_method(func: Any, first: torch.Tensor, args: tuple[Any, ...]) -> bool:
    """Casts and copies: Tensor methods named as such."""
    return getattr(func, "__name__", "") in ("float", "double", "half", "bfloat16", "to", "contiguous", "type_as")


def _keeps_last(index: Any, ndim: int) -> bool:
    items = list(index) if isinstance(index, tuple) else [index]
    if any(item is Ellipsis or isinstance(item, (torch.Tensor, list)) or item is None for item in items):
        return False
    return len(items) < ndim or items[-1] == slice(None)


def _flattens_last(args: tuple[Any, ...], kwargs: Any, ndim: int) -> bool:
    end = args[2] if len(args) > 2 else kwargs.get("end_dim", -1)
    return int(end) % ndim == ndim - 1


class ShardedLogitsLoss:
    """A user's loss function, run over class-sharded logits under :class:`ShardedLogitsMode`."""

    def __init__(self, loss_fn: Callable[..., torch.Tensor]) -> None:
        self.loss_fn = loss_fn

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The user's loss; parallel where the logits reach ``F.cross_entropy``."""
        with ShardedLogitsMode():
            return self.loss_fn(*args, **kwargs)
