"""The part of a logical tensor a rank holds, under any layout: the whole tensor's shape and this rank's rectangles.

A parameter (or an optimizer state shaped like it) is one *logical* tensor, the one the user's model has. A rank
holds all of it (a plain tensor), the piece a split cut (``_epl_shard_spec``: a plain local slice, in several
strips along the split dim for a fused tensor with ``parts > 1``), a chunk of it (a ``DTensor``: FSDP2's
``Shard(0)`` over the copies, ``Replicate`` over the replicas of a hybrid mesh), or a chunk of a split piece (a
``DTensor`` whose global shape is the piece, with the split spec set on it). :func:`held` says which rectangles of
the logical tensor that is, and where each lies in the rank's local tensor, so checkpoints and pretrained files are
read and written a rectangle at a time, with no collective and nothing gathered.

``DTensor`` chunks follow ``torch.chunk`` (FSDP2's rule): ``ceil(rows / n)`` rows per rank, the last ranks short
or empty; a rank may hold no element of a tensor (7 rows over 4: 2, 2, 2, 1; 1 over 2: 1, 0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from epl.errors import EplError
from epl.sharding.data_shards import is_dtensor
from epl.sharding.parameters import ShardSpec, gather_split, shard_spec
from epl.torch_private import dtensor_like

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class Block:
    """One rectangle of a logical tensor that a rank holds: ``sizes`` elements from ``offsets`` of the whole,
    found from ``start`` of the rank's local tensor."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: tuple[int, ...]

    def numel(self) -> int:
        """How many elements the rectangle holds."""
        return math.prod(self.sizes)

    def in_local(self, local: torch.Tensor) -> torch.Tensor:
        """The rectangle's view of the rank's ``local`` tensor."""
        return _narrow(local, self.start, self.sizes)

    def in_whole(self, whole: torch.Tensor) -> torch.Tensor:
        """The rectangle's view of the logical ``whole`` tensor."""
        return _narrow(whole, self.offsets, self.sizes)


@dataclass(frozen=True)
class Held:
    """What a rank holds of one logical tensor: the logical ``shape``, the shape of the rank's local tensor, and the
    rectangles (``blocks``: none empty, in the order of the local tensor) that tile the local tensor. A rank that
    holds no element of it has no block."""

    shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    blocks: tuple[Block, ...]

    @property
    def whole(self) -> bool:
        """Whether the rank holds all of the logical tensor."""
        return self.local_shape == self.shape

    def take(self, whole: torch.Tensor) -> torch.Tensor:
        """The rank's local tensor cut from the logical ``whole`` (a view of it when one rectangle)."""
        if tuple(whole.shape) != self.shape:
            raise EplError(f"A tensor of shape {list(whole.shape)} is not the logical {list(self.shape)}.")
        return self.assemble([block.in_whole(whole) for block in self.blocks], dtype=whole.dtype, device=whole.device)

    def assemble(
        self, parts: Sequence[torch.Tensor], *, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """The rank's local tensor from the values of its rectangles (``parts``, one per block, in order): the one
        part itself when it is the whole local tensor, else a new tensor (``dtype``, on ``device`` when empty)."""
        if len(parts) != len(self.blocks):
            raise EplError(f"{len(parts)} values for the {len(self.blocks)} rectangles of a {list(self.shape)} tensor.")
        for part, block in zip(parts, self.blocks, strict=True):
            if tuple(part.shape) != block.sizes:
                raise EplError(f"A value of shape {list(part.shape)} for a rectangle of {list(block.sizes)}.")
        if len(parts) == 1 and self.blocks[0].sizes == self.local_shape:
            return parts[0]
        local = torch.empty(self.local_shape, dtype=dtype, device=parts[0].device if parts else device)
        for part, block in zip(parts, self.blocks, strict=True):
            block.in_local(local).copy_(part)
        return local

    def rows(self) -> list[tuple[int, int]] | None:
        """The rows (dim 0 ranges of the logical tensor, in local order) when every rectangle spans all of the other
        dims, else None."""
        if not self.shape or any(b.sizes[1:] != self.shape[1:] for b in self.blocks):
            return None
        return [(b.offsets[0], b.offsets[0] + b.sizes[0]) for b in self.blocks]


def held(tensor: torch.Tensor, *, like: torch.Tensor | None = None, split: bool = True) -> Held:
    """What this rank holds of the logical tensor ``tensor`` belongs to.

    ``like``: the parameter whose split spec applies (an optimizer state shaped like its parameter; a state of
    another shape, such as Adam's ``step``, is held whole); default ``tensor`` itself. ``split=False``: within the
    split piece, ignoring the spec (the logical tensor is the piece).
    """
    spec = _spec_of(tensor, like) if split else None
    if is_dtensor(tensor):
        piece, offsets, sizes = tuple(tensor.shape), *_dtensor_box(tensor)
    else:
        piece = sizes = tuple(tensor.shape)
        offsets = (0,) * len(piece)
    if spec is None:
        blocks = (Block(offsets, sizes, (0,) * len(sizes)),) if math.prod(sizes) else ()
        return Held(piece, sizes, blocks)
    return _within_split(piece, offsets, sizes, spec)


def placed_like(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``local`` (values of what this rank holds of ``like``) as ``like`` holds them: a ``DTensor`` on ``like``'s
    mesh and placements, in its dtype and on its device (on ``local``'s where ``like`` is on ``meta``, being given
    values), when ``like`` is one; else ``local`` itself."""
    if not is_dtensor(like):
        return local
    from torch.distributed.tensor import DTensor

    own = like.to_local()
    if tuple(local.shape) != tuple(own.shape):
        raise EplError(f"A value of shape {list(local.shape)} where this rank holds {list(own.shape)}.")
    local = local.to(dtype=own.dtype, device=local.device if own.is_meta else own.device)
    if not local.is_meta and local.device.type != like.device_mesh.device_type:
        # a chunk in host memory on a GPU's mesh (offload): from_local would move it to the GPU (as FSDP2 builds
        # its host chunks: with the constructor, which keeps it where it is)
        return dtensor_like(local, like)
    return DTensor.from_local(
        local,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def whole_of(tensor: torch.Tensor, *, like: torch.Tensor | None = None) -> torch.Tensor:
    """The logical tensor, gathered whole: a collective over the ``DTensor``'s mesh, then over the split group
    (every rank holding part of it calls it). Transient memory: this one tensor."""
    value = tensor.full_tensor() if is_dtensor(tensor) else tensor
    return gather_split(value, _spec_of(tensor, like))


# -- the rectangles --------------------------------------------------------------------------------------------
def _spec_of(tensor: torch.Tensor, like: torch.Tensor | None) -> ShardSpec | None:
    """The split spec that applies to ``tensor``: its own, or ``like``'s when ``tensor`` is shaped like ``like``
    (a ``DTensor`` state of a ``DTensor`` parameter, or a plain state of a plain parameter's shape)."""
    if like is None:
        return shard_spec(tensor)
    if is_dtensor(tensor) != is_dtensor(like) or tuple(tensor.shape) != tuple(like.shape):
        return None
    return shard_spec(like)


def _dtensor_box(tensor: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The offsets and sizes of the rectangle a ``DTensor``'s local tensor holds of its global tensor (torch.chunk's
    rule per ``Shard`` mesh dim, in mesh order; ``Replicate`` holds all)."""
    from torch.distributed.tensor import Replicate, Shard

    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise EplError(f"This rank is not in the mesh of a DTensor of shape {list(tensor.shape)}.")
    offsets, sizes = [0] * tensor.dim(), list(tensor.shape)
    for axis, placement in enumerate(tensor.placements):
        if isinstance(placement, Replicate):
            continue
        if type(placement) is not Shard:  # _StridedShard, Partial: not a layout EPL makes
            raise EplError(f"A DTensor placed {tensor.placements} has no rectangle EPL can read or write.")
        dim, count = placement.dim, mesh.size(axis)
        step = -(-sizes[dim] // count)
        first = min(coordinate[axis] * step, sizes[dim])
        offsets[dim] += first
        sizes[dim] = min(sizes[dim], first + step) - first
    local = tuple(tensor.to_local().shape)
    if local != tuple(sizes):
        raise EplError(
            f"A DTensor of shape {list(tensor.shape)} placed {tensor.placements} holds {list(local)} here, not the "
            f"{sizes} of torch.chunk's rule."
        )
    return tuple(offsets), tuple(sizes)


def _within_split(piece: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...], spec: ShardSpec) -> Held:
    """The rectangles of the logical tensor for the rectangle (``offsets``, ``sizes``) of a split ``piece``: one per
    strip of a fused tensor that it meets."""
    dim, group = spec.dim, spec.group
    part = spec.size // spec.parts
    start, length = group.slice(part).start, group.sizes(part)[group.index]
    if dim >= len(piece) or piece[dim] != length * spec.parts:
        raise EplError(
            f"A split piece of shape {list(piece)} is not shard {group.index} of {group.count} of {spec.size} along "
            f"dim {dim} ({spec.parts} part(s)): its split spec does not describe it."
        )
    shape = (*piece[:dim], spec.size, *piece[dim + 1 :])
    blocks = []
    low, high = offsets[dim], offsets[dim] + sizes[dim]
    for strip in range(spec.parts):
        first, last = max(low, strip * length), min(high, (strip + 1) * length)
        if last <= first or not math.prod(sizes):
            continue
        at = strip * part + start + first - strip * length
        blocks.append(
            Block(
                (*offsets[:dim], at, *offsets[dim + 1 :]),
                (*sizes[:dim], last - first, *sizes[dim + 1 :]),
                (0,) * dim + (first - low,) + (0,) * (len(piece) - dim - 1),
            )
        )
    return Held(shape, sizes, tuple(blocks))


def _narrow(tensor: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    for dim, (offset, size) in enumerate(zip(offsets, sizes, strict=True)):
        if offset or size != tensor.shape[dim]:
            tensor = tensor.narrow(dim, offset, size)
    return tensor
