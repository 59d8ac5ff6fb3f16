"""EPL's memory techniques, switched on by the manual's config keys.

``gradient_checkpoint.type``: ``collection`` recomputes the modules marked with
:func:`checkpoint`; ``auto`` lets EPL choose (repeated blocks, else about sqrt(N)
balanced segments).
"""

from epl_memory.checkpointing import checkpoint

__all__ = ["checkpoint"]
