"""EPL's memory techniques, switched on by the manual's config keys.

``gradient_checkpoint.type``: ``collection`` recomputes the modules marked with
:func:`checkpoint`; ``auto`` lets EPL choose (repeated blocks, else about sqrt(N)
balanced segments). ``zero.level = "v0"``: each copy of a parameter group keeps the
optimizer state of its own partition (:mod:`epl_memory.zero`).

Names are imported on first use: loading this plugin (e.g. for ``epl launch``)
must not import PyTorch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from epl_memory.checkpointing import checkpoint

__all__ = ["checkpoint"]


def __getattr__(name: str) -> Any:
    if name == "checkpoint":
        from epl_memory.checkpointing import checkpoint

        return checkpoint
    raise AttributeError(f"module 'epl_memory' has no attribute {name!r}")
