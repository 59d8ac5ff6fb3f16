"""Checkpoint names that transformers converts at load time: renamed keys, and tensors built from several.

transformers stores some models in a format older than their modules: Mixtral's experts one by one
(``block_sparse_moe.experts.3.w1.weight``) where the model holds them stacked (``mlp.experts.gate_up_proj``).
Its ``from_pretrained`` converts them with the model's *conversion mapping* (``get_model_conversion_mapping``:
renamings, and converters whose operations stack, concatenate or split tensors), and its ``save_pretrained``
writes the old format back. :func:`conversions` reads that mapping, transformers' own, and says how each of the
model's names is made from the checkpoint's; :meth:`Converted.read` runs the converter's own operations.

A rank reads only what it holds where the operations allow it: a piece along the stacking dimension of a
``MergeModulelist`` (experts split across ranks) reads only its experts' tensors. Any other piece of a converted
tensor is made whole, one tensor at a time, and sliced.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from epl.errors import EplError
from epl.pretrained.pieces import Piece


@dataclass
class Converted:
    """One of the model's tensors made by a transformers converter from checkpoint tensors: for each of the
    converter's source patterns, the checkpoint names it matched, in the order transformers stacks them."""

    converter: Any
    sources: dict[str, list[str]] = field(default_factory=dict)

    def names(self) -> list[str]:
        """Every checkpoint name it reads."""
        return [name for group in self.sources.values() for name in group]

    def read(self, target: str, piece: Piece, load: Callable[[str, Piece | None], torch.Tensor]) -> torch.Tensor:
        """The ``piece`` of the tensor ``target``, from checkpoint tensors that ``load(name, piece)`` reads (a piece
        of None: whole)."""
        if not piece.blocks:  # this rank holds none of it (a chunk of no rows)
            return torch.empty(piece.local_shape)
        selected = self._merged_rows(piece)
        if selected is not None:  # only this piece's rows of the stack: read those sources, whole
            collected = {p: [load(n, None) for n in names] for p, names in selected.items()}
            return self._run(target, collected)
        collected = {p: [load(n, None) for n in names] for p, names in self.sources.items()}
        return piece.take(self._run(target, collected))

    def _merged_rows(self, piece: Piece) -> dict[str, list[str]] | None:
        """The sources of the piece alone, when the piece is rows (dim 0 ranges) of the whole, the first operation
        stacks each pattern's tensors along dim 0 and the others leave that dimension alone."""
        from transformers.core_model_loading import Concatenate, MergeModulelist

        operations = self.converter.operations
        rows = None if piece.whole else piece.rows()
        if rows is None or not operations or not isinstance(operations[0], MergeModulelist):
            return None
        if operations[0].dim != 0 or not all(isinstance(op, Concatenate) and op.dim > 0 for op in operations[1:]):
            return None
        return {p: [n for a, b in rows for n in names[a:b]] for p, names in self.sources.items()}

    def _run(self, target: str, sources: dict[str, list[torch.Tensor]]) -> torch.Tensor:
        converter = self.converter
        # Lists of tensors in; the operations' results (annotated as lists by transformers) are tensors.
        collected: dict[str, Any] = sources
        try:
            with torch.no_grad():
                for operation in converter.operations:
                    collected = operation.convert(
                        collected,
                        source_patterns=converter.source_patterns,
                        target_patterns=converter.target_patterns,
                        full_layer_name=target,
                    )
            (value,) = collected.values()
        except Exception as error:  # noqa: BLE001 - transformers' operations do not say which tensors
            names = self.names()
            raise EplError(
                f"Cannot build {target!r} from the checkpoint's {names[:3]}{' ...' if len(names) > 3 else ''} with "
                f"transformers' conversion ({type(error).__name__}: {error}): the checkpoint's tensors do not fit "
                "the model's config. Load the checkpoint of this model's class and config."
            ) from None
        return value


def conversions(model: nn.Module, saved: list[str], wanted: set[str]) -> tuple[dict[str, str], dict[str, Converted]]:
    """How the model's names in ``wanted`` come from the checkpoint's names ``saved`` by transformers' conversion
    mapping of ``model``: model name -> checkpoint name (renamed only), and model name -> :class:`Converted`.
    Empty for a model transformers has no mapping for (or without transformers)."""
    mapping = _mapping_of(model)
    if not mapping:
        return {}, {}
    from transformers.core_model_loading import WeightConverter, rename_source_key

    renamings = [t for t in mapping if not isinstance(t, WeightConverter)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    prefix = getattr(model, "base_model_prefix", None)
    names = dict.fromkeys(wanted, True)  # transformers asks `.get(name) is not None` of a state dict
    renamed: dict[str, str] = {}
    converted: dict[str, Converted] = {}
    for name in sorted(saved, key=_natural):
        target, pattern = rename_source_key(name, renamings, converters, prefix or None, names)
        if target not in wanted or target == name:
            continue
        if pattern is None:
            renamed[target] = name
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        entry = converted.setdefault(target, Converted(converter))
        entry.sources.setdefault(pattern, []).append(name)
    for entry in converted.values():  # the converter's order of patterns (gate before up), as transformers keeps
        entry.sources = {p: entry.sources[p] for p in entry.converter.source_patterns if p in entry.sources}
    return renamed, converted


def _mapping_of(model: nn.Module) -> list[Any]:
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return []
    if not isinstance(model, PreTrainedModel):
        return []
    return list(get_model_conversion_mapping(model))


def _natural(name: str) -> list[Any]:
    """Sort key: numbers as numbers (``experts.10`` after ``experts.9``)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]
