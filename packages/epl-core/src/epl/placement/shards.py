"""What one device of a split TaskGraph holds, summarised for the Plan: :class:`ShardRow`.

Parameters alike (same name once layer numbers become ``*``, same module type, same
shard and whole shapes) make one row with a count, so a 32-layer model takes a few lines:
``layers.*.mlp.gate_proj.weight [32, 16] of [64, 16] x32``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class ShardRow:
    """Parameters alike on one device of a split TaskGraph: a name (pattern), shapes and how many."""

    #: The parameter's name, layer numbers as ``*`` when the row counts several.
    name: str
    #: The type name of the module holding it in the model ("" when the model has none of that name).
    module: str
    #: The shape the device holds.
    shape: tuple[int, ...]
    #: The whole parameter's shape; None when the model has no parameter of that name.
    whole: tuple[int, ...] | None
    #: A shard of a split tensor (False: the device holds it whole).
    sharded: bool
    #: The other names of the same tensor in the model (tied weights).
    tied: tuple[str, ...] = ()
    #: How many parameters the row stands for.
    count: int = 1
    #: Why a parameter of a split TaskGraph is held whole ("" when sharded, or when no estimate says).
    why: str = ""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ShardRow:
        """Rebuild a row from ``dataclasses.asdict`` output (JSON lists back to tuples)."""
        whole = data.get("whole")
        shapes = {"shape": tuple(data["shape"]), "whole": None if whole is None else tuple(whole)}
        return cls(**{**data, **shapes, "tied": tuple(data.get("tied", ()))})

    def cells(self) -> list[str]:
        """The row as table cells: name, shape, of what, how many."""
        if not self.sharded:
            of = "whole"
        else:
            of = "of ?" if self.whole is None else f"of {_shape(self.whole)}"
        tied = f" (tied to {', '.join(self.tied)})" if self.tied else ""
        return [self.name + tied, _shape(self.shape), of, f"x{self.count}" if self.count > 1 else ""]


def summarise(held: Iterable[ShardRow]) -> tuple[ShardRow, ...]:
    """``held`` (a row per parameter) merged where only layer numbers differ, in order of first appearance."""
    groups: dict[ShardRow, list[ShardRow]] = {}
    for row in held:
        key = replace(row, name=layer_pattern(row.name), tied=tuple(map(layer_pattern, row.tied)), count=1)
        groups.setdefault(key, []).append(row)
    return tuple(
        replace(key, count=sum(r.count for r in rows)) if len(rows) > 1 else rows[0] for key, rows in groups.items()
    )


def layer_pattern(name: str) -> str:
    """``layers.3.mlp.up_proj.weight`` -> ``layers.*.mlp.up_proj.weight``."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


def same_positions(rows: Sequence[tuple[ShardRow, ...]]) -> list[tuple[list[int], tuple[ShardRow, ...]]]:
    """The positions holding the same rows, grouped: ``[([0, 1], rows)]`` when every device holds alike."""
    grouped: dict[tuple[ShardRow, ...], list[int]] = {}
    for position, held in enumerate(rows):
        grouped.setdefault(held, []).append(position)
    return [(positions, held) for held, positions in grouped.items()]


def _shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


#: A device holding more than this share of a split TaskGraph's elements whole is reported: a note in ``epl plan``,
#: a warning at ``epl.parallelize``.
MOSTLY_WHOLE = 0.5


def kept_whole_note(rows: Sequence[ShardRow]) -> str | None:
    """A note naming the largest parameters kept whole and why, when ``rows`` (one device's) hold most of their
    elements whole; None otherwise."""
    whole = [(math.prod(r.shape) * r.count, r) for r in rows if not r.sharded]
    total = sum(math.prod(r.whole or r.shape) * r.count for r in rows)
    kept = sum(n for n, _ in whole)
    if not total or kept <= MOSTLY_WHOLE * total:
        return None
    largest = sorted(whole, key=lambda item: -item[0])[:5]
    named = "; ".join(f"{r.name} ({n:,} elements{': ' + r.why if r.why else ''})" for n, r in largest)
    return f"this device keeps {100 * kept / total:.0f}% of the elements whole. Largest: {named}"
