"""Which part of a whole tensor a rank holds, and the safetensors names of dtypes."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from epl.runtime.checkpoint import CheckpointedEngine

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
#: safetensors' names of the dtypes it stores.
DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip
#: Bytes per element of each safetensors dtype.
_ITEMSIZE: dict[str, int] = {code: dtype.itemsize for dtype, code in DTYPES.items()}


# -- which part of a whole tensor a rank holds ----------------------------------------------------------------
@dataclass(frozen=True)
class Piece:
    """The part of a whole tensor one rank holds: along ``dim`` (of ``size`` items in the whole), the index
    ``ranges`` (start, stop), in order (several for a fused tensor's parts); ``dim`` -1: all of it."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    size: int = 0

    @staticmethod
    def of(tensor: torch.Tensor) -> Piece:
        """The piece ``tensor`` (a parameter or buffer of this rank's model) holds of its whole."""
        from epl.sharding.parameters import shard_spec

        spec = shard_spec(tensor)
        if spec is None:
            return Piece(-1, ())
        part = spec.size // spec.parts
        start, length = spec.group.slice(part).start, spec.group.sizes(part)[spec.group.index]
        ranges = tuple((j * part + start, j * part + start + length) for j in range(spec.parts))
        return Piece(spec.dim, ranges, spec.size)

    def whole_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        """The whole tensor's shape, from the shape of the piece."""
        if self.dim < 0:
            return local
        return (*local[: self.dim], self.size, *local[self.dim + 1 :])

    def elements(self, shape: tuple[int, ...]) -> int:
        """The elements of the piece of a whole tensor of ``shape``."""
        if self.dim < 0:
            return math.prod(shape)
        return sum(b - a for a, b in self.ranges) * math.prod(shape) // shape[self.dim]

    def take(self, whole: torch.Tensor) -> torch.Tensor:
        """The piece of the ``whole`` tensor."""
        if self.dim < 0:
            return whole
        parts = [whole.narrow(self.dim, a, b - a) for a, b in self.ranges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)

    def read(self, view: Any) -> torch.Tensor:
        """The piece from a safetensors slice ``view`` (``safe_open(...).get_slice(name)``)."""
        if self.dim < 0:
            return view[:]
        parts = []
        for a, b in self.ranges:
            index = tuple([slice(None)] * self.dim + [slice(a, b)])
            parts.append(view[index])
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)


def local_tensors(engine: CheckpointedEngine) -> Iterator[tuple[str, torch.Tensor, Piece]]:
    """Each (name, this rank's tensor, its piece of the whole) of the model's state."""
    for name, tensor in engine.model.state_dict(keep_vars=True).items():
        yield name, tensor, Piece.of(tensor)
