"""The manual's examples as annotated PyTorch models (``epl plan --example NAME``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from epl.examples.manual import ManualExample

#: The examples' names, known without importing PyTorch (tests check them against EXAMPLES).
NAMES = ("bert_stages", "by_hand", "classification", "data_parallel", "moe", "pipeline")


def names() -> list[str]:
    """Names of the examples."""
    return list(NAMES)


def get(name: str) -> ManualExample:
    """The example called ``name``."""
    from epl.examples.manual import EXAMPLES

    if name not in EXAMPLES:
        raise KeyError(f"No example {name!r}; the examples are {', '.join(names())}.")
    return EXAMPLES[name]


__all__ = ["NAMES", "get", "names"]
