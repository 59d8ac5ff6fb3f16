"""The manual's examples as annotated PyTorch models (``epl plan --example NAME``)."""

from __future__ import annotations

from epl.examples.manual import EXAMPLES, ManualExample


def names() -> list[str]:
    """Names of the examples."""
    return sorted(EXAMPLES)


def get(name: str) -> ManualExample:
    """The example called ``name``."""
    if name not in EXAMPLES:
        raise KeyError(f"No example {name!r}; the examples are {', '.join(names())}.")
    return EXAMPLES[name]


__all__ = ["EXAMPLES", "ManualExample", "get", "names"]
