"""A rank's rectangles of a logical tensor, as torch.distributed.checkpoint (DCP) writes and reads them.

:class:`Rectangles` is a tensor of the logical shape that holds only this rank's rectangles of it
(:func:`epl.sharding.chunks.held`). It implements DCP's write and read protocol (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``, as ``DTensor`` does), so DCP stores each rectangle at its
offsets under the logical key and writes each element once: ranks holding the same rectangle (replicas) share one
write, and a load asks for any rectangles, whatever rectangles were saved. It is used for every tensor a rank does
not hold whole, ``DTensor`` chunks included (their zero-row chunks are no rectangle at all, which DCP's own
``DTensor`` support does not allow for every layout). A tensor held whole is handed to DCP as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from epl.sharding.chunks import Held


class Rectangles(torch.Tensor):
    """The rectangles (``blocks``: offsets in the logical tensor, and the values) a rank holds of a logical tensor
    of ``shape``; no operation of torch applies to it, DCP reads its rectangles."""

    blocks: list[tuple[tuple[int, ...], torch.Tensor]]

    @staticmethod
    def __new__(
        cls, shape: Sequence[int], blocks: Sequence[tuple[Sequence[int], torch.Tensor]], dtype: torch.dtype
    ) -> Rectangles:
        """Rectangles of a logical tensor of ``shape`` and ``dtype``: each block's offsets in it and its values."""
        device = blocks[0][1].device if blocks else torch.device("cpu")
        made = torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=dtype, device=device)
        made.blocks = [(tuple(offsets), value) for offsets, value in blocks]
        return made

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # a classmethod, as torch's subclasses have it
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        if func is torch.ops.aten.detach.default:  # DCP detaches what it is given
            return args[0]
        raise NotImplementedError(f"Rectangles of a checkpoint support no {func}.")

    def __repr__(self) -> str:  # type: ignore[override]  # Tensor's takes tensor_contents=, unused here
        shown = ", ".join(f"{list(offsets)}+{list(value.shape)}" for offsets, value in self.blocks)
        return f"Rectangles({list(self.shape)}, {self.dtype}, [{shown}])"

    def parts(self) -> list[torch.Tensor]:
        """The values of the rectangles, in order."""
        return [value for _, value in self.blocks]

    def holding(self, parts: Sequence[torch.Tensor]) -> Rectangles:
        """The same rectangles holding ``parts``."""
        blocks = [(offsets, value) for (offsets, _), value in zip(self.blocks, parts, strict=True)]
        return Rectangles(self.shape, blocks, self.dtype)

    # -- DCP's protocol -------------------------------------------------------------------------------------------
    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk,
                    properties=TensorProperties.create_from_tensor(value.detach()),
                    size=self.shape,
                ),
            )
            for (offsets, value), chunk in zip(self.blocks, self.__create_chunk_list__(), strict=True)
        ]

    def __create_chunk_list__(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=value.shape) for offsets, value in self.blocks]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        offsets = tuple(index.offset) if index.offset is not None else None
        for at, value in self.blocks:
            if at == offsets:
                return value
        raise ValueError(f"No rectangle at {offsets} of {index.fqn}.")


def to_write(held: Held, local: torch.Tensor) -> torch.Tensor:
    """What DCP is handed for the logical tensor of which ``local`` holds ``held``: ``local`` when it is whole,
    else its :class:`Rectangles` (views of ``local``, nothing copied)."""
    local = local.detach()
    if held.whole:
        return local
    return Rectangles(held.shape, [(b.offsets, b.in_local(local)) for b in held.blocks], local.dtype)


def to_read(held: Held | None, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A placeholder DCP reads into (never written: :func:`epl.runtime.checkpoint.files.safe_reader` keeps what it
    reads instead): the whole tensor of ``shape`` (``held`` None or whole), else this rank's rectangles."""
    if held is None or held.whole:
        return torch.empty(tuple(shape), dtype=dtype)
    return Rectangles(held.shape, [(b.offsets, torch.empty(b.sizes, dtype=dtype)) for b in held.blocks], dtype)


def local_value(value: torch.Tensor, held: Held) -> torch.Tensor:
    """This rank's local tensor from what was read for it: its :class:`Rectangles`, or the logical whole (cut), or
    a tensor of another shape (kept: an optimizer's ``step``)."""
    if isinstance(value, Rectangles):
        return held.assemble(value.parts(), dtype=value.dtype)
    if not held.whole and tuple(value.shape) == held.shape:
        return held.take(value).clone()
    return value
