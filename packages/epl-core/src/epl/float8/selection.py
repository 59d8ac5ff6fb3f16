"""Which linear layers of a model train in float8, decided on the whole model, each exclusion with its reason.

As torchtitan: the output head stays in high precision (as does everything outside the repeated blocks: the
embeddings and any projection around the blocks), and so do the first and the last repeated block, where
float8's error matters most; ``float8.exclude`` names more. A linear whose dimensions are not multiples of 16
cannot run torch's ``_scaled_mm`` and stays too (torchtitan's auto-filter).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

from epl.compiling.blocks import repeated_blocks
from epl.errors import ConfigError

#: torch's float8 matmul (``_scaled_mm``) needs both dimensions of the weight to be multiples of this.
ALIGNMENT = 16


@dataclass(frozen=True)
class Float8Choice:
    """The linears (by qualified name) that become float8, and those that stay, with the reason of each."""

    converted: tuple[str, ...] = ()
    kept: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """One line: how many convert, and which stay by reason."""
        by_reason: dict[str, list[str]] = {}
        for name, reason in self.kept.items():
            by_reason.setdefault(reason, []).append(name)
        stays = "; ".join(f"{reason}: {', '.join(names)}" for reason, names in by_reason.items())
        return f"{len(self.converted)} linears in float8" + (f"; high precision ({stays})" if stays else "")


def matches(name: str, patterns: Sequence[str]) -> bool:
    """Whether ``name`` or a module above it matches one of the fnmatch ``patterns``."""
    parts = name.split(".")
    prefixes = [".".join(parts[: i + 1]) for i in range(len(parts))]
    return any(fnmatch.fnmatchcase(prefix, pattern) for pattern in patterns for prefix in prefixes)


def _inside(name: str, root: str) -> bool:
    return name == root or name.startswith(f"{root}.")


def choose_linears(model: nn.Module, exclude: Sequence[str] = ()) -> Float8Choice:
    """The float8 choice for ``model`` (whole, before any transform), ``exclude`` adding fnmatch patterns of module
    names (a pattern keeps a module and everything below it).

    Raises ConfigError when a pattern matches no module (a misspelt name would otherwise exclude nothing)."""
    wrong = [pattern for pattern in exclude if not isinstance(pattern, str)]
    if wrong:
        raise ConfigError(f"float8.exclude takes module name patterns (strings), not {wrong}.")
    names = [name for name, _ in model.named_modules() if name]
    unmatched = [pattern for pattern in exclude if not any(matches(name, [pattern]) for name in names)]
    if unmatched:
        raise ConfigError(
            f"float8.exclude: {unmatched} match no module of the model. Patterns are fnmatch patterns of qualified "
            f"module names (print(model) shows them), such as 'model.layers.2' or '*.mlp.down_proj'."
        )
    linears = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    blocks = [name for name, _ in repeated_blocks(model)]
    edge = {blocks[0], blocks[-1]} if blocks else set()
    if not blocks and linears:  # no repeated blocks: the first and the last linear are the model's edges
        edge = {linears[0][0], linears[-1][0]}
    converted: list[str] = []
    kept: dict[str, str] = {}
    for name, linear in linears:
        if exclude and matches(name, exclude):
            kept[name] = "float8.exclude"
        elif any(_inside(name, root) for root in edge):
            kept[name] = "first or last layer"
        elif blocks and not any(_inside(name, root) for root in blocks):
            kept[name] = "outside the repeated blocks (head, embeddings)"
        elif linear.in_features % ALIGNMENT or linear.out_features % ALIGNMENT:
            kept[name] = f"dimensions not multiples of {ALIGNMENT}"
        else:
            converted.append(name)
    return Float8Choice(tuple(converted), kept)
