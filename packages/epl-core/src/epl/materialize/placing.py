"""Values for exactly the tensors a rank keeps, after the model transforms kept its stage and its shards.

Names are the link: a transform that replaces a module keeps its name (a split layer's shard is
``model.layers.0.mlp.up_proj.weight`` as the whole weight was), so each ``meta`` tensor of this rank's model
is found in the model as built, and the init unit holding it there gives the values. A tensor kept whole gets
the unit's values; a shard (:func:`epl.sharding.parameters.shard_spec`) gets its slice of them, and a chunk over
the copies (a ``DTensor`` ZeRO made: :mod:`epl.sharding.data_shards`) the rows this device holds of that. Units
are taken one at a time, in order, so a rank holds what it keeps plus one unit's whole values.
"""

from __future__ import annotations

import torch
from torch import nn

from epl.errors import EplError
from epl.materialize.heap import FreedMemory
from epl.materialize.streaming import StreamedInit
from epl.materialize.swap import swap_values
from epl.materialize.units import named_tensors
from epl.sharding.chunks import held
from epl.sharding.data_shards import data_shards, is_dtensor
from epl.sharding.parameters import shard_spec


def materialize_kept(model: nn.Module, stream: StreamedInit, device: torch.device) -> int:
    """Give values on ``device`` (a chunk marked with another home: there) to every ``meta`` tensor of ``model``
    (this rank's model after the transforms), from the model as built that ``stream`` knows.
    Returns the number of elements given values."""
    wanted: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    seen: set[int] = set()
    for name, local in named_tensors(model):
        if not local.is_meta or id(local) in seen:
            continue
        seen.add(id(local))
        original = stream.built.get(name)
        if original is None or id(original) not in stream.first:
            raise EplError(
                f"{name!r} of this rank's model is on the meta device but was not a tensor of the model as built, "
                "so EPL does not know its values. A model transform made it on meta: make it with values."
            )
        wanted.append((name, local, original))
    count = 0
    heap = FreedMemory()
    for unit, members in stream.by_unit(wanted, lambda item: item[2]):
        values = stream.values(unit)
        for name, local, original in members:
            shards = data_shards(local)
            home = shards.home if shards is not None and shards.home is not None else device  # offload: the host
            part = _part(name, local, values[id(original)]).to(home).contiguous()
            if part.untyped_storage().nbytes() > part.nbytes:  # a slice's view would keep the unit's values alive
                part = part.clone()
            swap_values(local, part)
            count += part.numel()
        heap.freed(sum(value.nbytes for value in values.values()))
        del values  # before the next unit's values: one unit at a time
    heap.trim()
    return count


def _part(name: str, local: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """The values ``local`` holds of ``whole``: all of them, its shard's slice, or its chunk of either."""
    spec = shard_spec(local)
    piece = whole if spec is None else spec.slice_of(whole)
    if is_dtensor(local):
        return held(local, split=False).take(piece)
    if spec is not None:
        return piece
    if local.shape != whole.shape:
        raise EplError(
            f"{name!r} of this rank's model has shape {list(local.shape)} but {list(whole.shape)} as built, and is no "
            "shard EPL made, so EPL cannot tell which of its values it holds."
        )
    return whole
