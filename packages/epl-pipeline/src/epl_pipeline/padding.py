"""Batches of any size for a pipeline's forward-only passes (``evaluate``, ``predict``): equal micro-batches.

A batch of n rows becomes at most ``pipeline.num_micro_batch`` (m) micro-batches of r rows
each: r = ceil(n / m), rounded up to a multiple of ``rows_multiple`` (the parts a
``replicate(k)`` stage shares each micro-batch out into). A batch that divides is cut as a
training step cuts it. One that does not has its last micro-batch padded to r rows by
repeating its last row; a dict's integer ``labels`` are padded with -100, the index that
transformers' losses (and ``nn.CrossEntropyLoss``) ignore, so a model's own loss leaves the
padding out. A micro-batch that would hold padding only is not run (1 row on 2 micro-batches
runs one micro-batch of 1 row). :func:`first_rows` takes the padding off outputs and targets.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from epl.plugin_api import BatchError, batch_size, micro_batches

#: The label transformers' losses and ``nn.CrossEntropyLoss`` ignore: padding rows' labels.
IGNORED_LABEL = -100


@dataclass(frozen=True)
class Cut:
    """A batch cut into micro-batches of ``rows`` rows each, the last one padded where the batch does not divide."""

    #: (inputs, targets) of each micro-batch to run.
    pieces: list[tuple[Any, Any]]
    #: The rows of each micro-batch that are the batch's own (the others are padding).
    real: list[int]
    #: Rows of every micro-batch, padding included.
    rows: int
    #: Rows of the batch (without padding).
    total: int


def cut(inputs: Any, targets: Any, parts: int, rows_multiple: int, *, call: str, own_loss: bool) -> Cut:
    """``inputs`` and ``targets`` (None stays None) in at most ``parts`` micro-batches of equal size, each a multiple
    of ``rows_multiple`` rows, the last one padded where needed.

    ``call`` names the user's call in errors; ``own_loss``: the loss is the model's own (no ``loss_fn``), so
    padding rows must carry labels it ignores (a dict's integer ``labels``) or the batch is refused.
    """
    total = batch_size(inputs)
    if total is None:
        raise BatchError(f"{call} got a batch without tensors: pass a tensor, or a tuple, list or dict of tensors.")
    if total == 0:
        raise BatchError(f"{call} got an empty batch (0 rows): pass at least one row.")
    rows = _round_up(_round_up(total, parts) // parts, rows_multiple)
    count = _round_up(total, rows) // rows
    padding = rows * count - total
    if not padding:
        return Cut(micro_batches(inputs, targets, count), [rows] * count, rows, total)
    target_rows = batch_size(targets) if targets is not None else None
    if target_rows is not None and target_rows != total:
        raise BatchError(
            f"{call} got {total} rows of inputs but {target_rows} rows of targets: pass one target row per input row."
        )
    if own_loss and not _labelled(inputs):
        raise BatchError(
            f"{call} got a batch of {total} rows, which does not divide into pipeline.num_micro_batch={parts} "
            f"micro-batches{_of_parts(rows_multiple)}, so its last micro-batch is padded to {rows} rows; without "
            "loss_fn the loss is the model's own, and EPL cannot keep the padding rows out of it. Pass a batch size "
            f"that is a multiple of {parts * rows_multiple}, pass loss_fn=... to epl.parallelize (the padding rows "
            "are cut from the outputs and targets before it), or give the model its targets as a dict's integer "
            "'labels' (padded with -100, which transformers' losses ignore)."
        )
    inputs = _padded(inputs, padding)
    targets = None if targets is None else _padded(targets, padding, labels=False)
    real = [min(rows, total - index * rows) for index in range(count)]
    return Cut(micro_batches(inputs, targets, count), real, rows, total)


def first_rows(value: Any, rows: int, keep: int) -> tuple[Any, bool]:
    """``value`` with every tensor of ``rows`` rows (dimension 0) cut to its first ``keep``, and whether any was
    (always True when nothing is to be cut)."""
    if keep == rows:
        return value, True
    leaves, structure = pytree.tree_flatten(value)
    kept, found = [], False
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == rows:
            leaf, found = leaf[:keep], True
        kept.append(leaf)
    return pytree.tree_unflatten(kept, structure), found


def _of_parts(rows_multiple: int) -> str:
    if rows_multiple == 1:
        return ""
    return f" that each share out over the pipeline's replicate stages ({rows_multiple} equal parts)"


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _labelled(batch: Any) -> bool:
    """Whether ``batch`` is a dict with integer ``labels``."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    return isinstance(labels, torch.Tensor) and not (labels.is_floating_point() or labels.is_complex())


def _padded(batch: Any, padding: int, *, labels: bool = True, key: Any = None) -> Any:
    """``batch`` with ``padding`` rows more: each tensor's last row repeated (a dict's integer ``labels``:
    :data:`IGNORED_LABEL`, where ``labels``)."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            return batch
        if labels and key == "labels" and not (batch.is_floating_point() or batch.is_complex()):
            extra = batch.new_full((padding, *batch.shape[1:]), IGNORED_LABEL)
        else:
            extra = batch[-1:].expand(padding, *batch.shape[1:])
        return torch.cat([batch, extra])
    return _rebuild(batch, lambda item_key, item: _padded(item, padding, labels=labels, key=item_key))


def _rebuild(batch: Any, change: Callable[[Any, Any], Any]) -> Any:
    """``batch`` with ``change(key, item)`` applied to each item of a tuple/list/dict (key None but in dicts),
    keeping its type."""
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(change(None, item) for item in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(change(None, item) for item in batch)
    if isinstance(batch, Mapping):
        items = {key: change(key, value) for key, value in batch.items()}
        rebuilt: Callable[[dict[Any, Any]], Any] = type(batch)  # a Mapping subclass built from a dict (or not)
        try:
            return rebuilt(items)
        except TypeError:
            return items
    return batch
