"""Which part of a whole tensor a rank holds, and the safetensors names of dtypes."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from epl.sharding.chunks import Held, held

if TYPE_CHECKING:
    from epl.runtime.checkpoint.common import CheckpointedEngine

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
#: safetensors' names of the dtypes it stores.
DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip
#: Bytes per element of each safetensors dtype.
_ITEMSIZE: dict[str, int] = {code: dtype.itemsize for dtype, code in DTYPES.items()}
_TORCH_DTYPES: dict[str, torch.dtype] = {code: dtype for dtype, code in DTYPES.items()}


def is_model_weights_file(name: str) -> bool:
    """Whether ``name`` is a weight file (or the index) of transformers' model format."""
    return name in (SINGLE, INDEX) or _SHARD.fullmatch(name) is not None


# -- which part of a whole tensor a rank holds ----------------------------------------------------------------
#: The part of a whole tensor one rank holds: its rectangles (:class:`epl.sharding.chunks.Held`): all of it, a
#: split piece (several strips for a fused tensor's parts), a ``DTensor``'s chunk, or a chunk of a split piece.
Piece = Held


def read(view: Any, piece: Piece | None) -> torch.Tensor:
    """The ``piece`` (None: all) of a tensor from its safetensors slice ``view`` (``safe_open(...).get_slice(name)``),
    a rectangle at a time: only those bytes are read."""
    if piece is None or piece.whole:
        return view[:]
    parts = [view[tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes, strict=True))] for b in piece.blocks]
    return piece.assemble(parts, dtype=_TORCH_DTYPES[view.get_dtype()])


def elements(piece: Piece) -> int:
    """The elements of the whole tensor the piece holds."""
    return sum(block.numel() for block in piece.blocks)


def local_tensors(engine: CheckpointedEngine) -> Iterator[tuple[str, torch.Tensor, Piece]]:
    """Each (name, this rank's tensor, its piece of the whole) of the model's state."""
    for name, tensor in engine.model.state_dict(keep_vars=True).items():
        yield name, tensor, held(tensor)
