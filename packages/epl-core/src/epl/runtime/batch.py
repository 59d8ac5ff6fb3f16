"""Batches as tensors, tuples/lists or dicts of tensors: moving, measuring and splitting them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from epl.errors import BatchError


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor on ``device`` (tensors already there are not copied)."""
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else batch.to(device, non_blocking=True)
    return _rebuild(batch, lambda item: to_device(item, device))


def _rebuild(batch: Any, change: Callable[[Any], Any]) -> Any:
    """``batch`` with ``change`` applied to each item of a tuple/list/dict, keeping its type."""
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(change(item) for item in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(change(item) for item in batch)
    if isinstance(batch, Mapping):
        items = {key: change(value) for key, value in batch.items()}
        rebuilt: Callable[[dict[Any, Any]], Any] = type(batch)  # a Mapping subclass built from a dict (or not)
        try:
            return rebuilt(items)
        except TypeError:
            return items
    return batch


def batch_size(batch: Any) -> int | None:
    """The common size of dimension 0 of every tensor in ``batch`` (None: no tensors)."""
    sizes = {t.shape[0] for t in tensors_in(batch) if t.dim() > 0}
    if len(sizes) > 1:
        raise BatchError(f"The tensors of one batch have different sizes in dimension 0: {sorted(sizes)}.")
    return sizes.pop() if sizes else None


def samples_and_tokens(batch: Any) -> tuple[int | None, int | None]:
    """How many samples and tokens ``batch`` holds, for throughput: (samples, tokens), None where unknown.

    Samples: dimension 0 of its first tensor. Tokens: the elements of its token ids, which are a dict's
    ``input_ids``, else its first integer tensor of two or more dimensions (batch x sequence).
    """
    if isinstance(batch, torch.Tensor):  # the same answer as below, without walking a structure
        if batch.dim() == 0:
            return None, None
        is_ids = batch.dim() >= 2 and not batch.is_floating_point() and not batch.is_complex()
        return batch.shape[0], batch.numel() if is_ids and batch.dtype != torch.bool else None
    tensors = [t for t in tensors_in(batch) if t.dim() > 0]
    if not tensors:
        return None, None
    ids = token_ids(batch, tensors)
    return tensors[0].shape[0], None if ids is None else ids.numel()


def token_ids(batch: Any, tensors: list[torch.Tensor] | None = None) -> torch.Tensor | None:
    """The token ids of ``batch``: a dict's ``input_ids``, else its first integer tensor of two or more dimensions
    (batch x sequence); None when it has none (or they are booleans). ``tensors``: ``tensors_in(batch)``, if known."""
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    if not isinstance(ids, torch.Tensor):
        candidates = tensors_in(batch) if tensors is None else tensors
        ids = next((t for t in candidates if t.dim() >= 2 and not t.is_floating_point() and not t.is_complex()), None)
    return None if ids is None or ids.dtype == torch.bool else ids


def split_batch(batch: Any, parts: int, *, what: str) -> list[Any]:
    """Split every tensor of ``batch`` into ``parts`` equal pieces along dimension 0.

    Non-tensor leaves are passed to every piece unchanged. ``what`` names the
    reason for the split in the error when the size does not divide.
    """
    if isinstance(batch, torch.Tensor) and batch.dim() > 0 and batch.shape[0] and not batch.shape[0] % parts:
        return list(batch.chunk(parts))  # the views _piece makes, in one call
    size = batch_size(batch)
    if size is None:
        raise BatchError(f"Cannot split a batch without tensors into {parts} parts for {what}.")
    if size % parts:
        raise BatchError(
            f"A batch of {size} samples cannot be split into {parts} equal parts for {what}. "
            f"Use a batch size that is a multiple of {parts}."
        )
    return [_piece(batch, index, size // parts) for index in range(parts)]


def micro_batches(inputs: Any, targets: Any, parts: int) -> list[tuple[Any, Any]]:
    """``inputs`` and ``targets`` (None stays None) cut into ``parts`` (inputs, targets) pairs,
    the sizes checked against ``pipeline.num_micro_batch``."""
    what = f"pipeline.num_micro_batch={parts}"
    pieces = split_batch(inputs, parts, what=what)
    targets_pieces = split_batch(targets, parts, what=what) if targets is not None else [None] * parts
    return list(zip(pieces, targets_pieces, strict=True))


def as_arguments(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The positional and keyword arguments ``inputs`` stand for: a tuple/list is positional
    arguments, a dict keywords; a namedtuple is one argument (models take it whole), like any other object."""
    if isinstance(inputs, (tuple, list)) and not hasattr(inputs, "_fields"):
        return tuple(inputs), {}
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    return (inputs,), {}


def call_model(model: nn.Module, inputs: Any) -> Any:
    """Call ``model`` with ``inputs`` taken as arguments by ``as_arguments``."""
    if isinstance(inputs, torch.Tensor):
        return model(inputs)
    args, kwargs = as_arguments(inputs)
    return model(*args, **kwargs)


def _piece(batch: Any, index: int, length: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.narrow(0, index * length, length) if batch.dim() > 0 else batch
    return _rebuild(batch, lambda item: _piece(item, index, length))


def tensors_in(batch: Any) -> list[torch.Tensor]:
    """Every tensor of ``batch`` (a tensor, or tuples/lists/dicts of them), in order."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, (tuple, list)):
        return [t for item in batch for t in tensors_in(item)]
    if isinstance(batch, Mapping):
        return [t for value in batch.values() for t in tensors_in(value)]
    return []
