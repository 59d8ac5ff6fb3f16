"""``compile.enabled``: each repeated block of the model compiled with ``torch.compile`` after EPL's transforms,
as torchtitan compiles each TransformerBlock (docs/compile.md).

- :func:`repeated_blocks` finds the blocks: the items of the largest list of same-type modules;
- :func:`compile_blocks` compiles their forwards, so the hooks EPL installs on modules (ZeRO's weight fetches,
  offload) stay eager around them, and what a backend cannot compile runs eager, named in the
  :class:`CompileReport`.
"""

from __future__ import annotations

from epl.compiling.blocks import repeated_blocks
from epl.compiling.compiled import CompileReport, CompileState, compile_blocks, without_kv_cache

__all__ = ["CompileReport", "CompileState", "compile_blocks", "repeated_blocks", "without_kv_cache"]
