"""Wrapped linear layers (PEFT's LoRA): sharded exactly as their base layer, the adapters following it.

A *wrapped linear* is a module holding no tensors of its own, with a ``base_layer`` child that
is an ``nn.Linear`` or linear-like (a 2-D ``weight`` and an optional ``bias`` vector: GPT-2's ``Conv1D``, its
weight ``[in, out]``), and whose every other parameter lies in ``nn.Linear`` adapters of two kinds:
those that *read* the wrapper's input (``in_features`` of the base: LoRA's ``lora_A``) and those
that *write* into its output (``out_features`` of the base: ``lora_B``), a reader's outputs being
a writer's inputs (the rank). PEFT's ``BaseTunerLayer`` wrappers of ``nn.Linear`` (LoRA, and the
methods built alike) are such modules, whatever their class: the rule is for the structure.

The layout treats the wrapper as one linear layer: the example run records its call as one
call, so Megatron's pairing holds through it (a wrapped ``o_proj`` row parallel, a wrapped
``q_proj`` column parallel). It pairs only when the example run shows its forward to be the
base's product plus the adapters' products, scaled and added (:func:`additive`); otherwise
its layout is ``alone`` (whole output), which is right whatever its forward does. Its shard:

- ``column``: the base column parallel; each writer cut by output rows as the base's output
  is (its input, the reader's whole output, entered with Megatron's *f*: one all-reduce of
  its gradient backward, ``rank`` features); readers whole. The adapters' sum is sharded as
  the base's output is.
- ``row``: the base row parallel; each reader cut by input columns, its partial output summed
  over the devices (one all-reduce forward, ``rank`` features), so each writer, whole, reads
  the whole reader output; the adapters' sum is whole as the base's output is.
- otherwise (``alone``, ``whole``): the base by the linear rule (whole output), adapters whole.

Each adapter thus adds one small collective per call to the base layer's, and no more.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from epl.errors import AnnotationError
from epl.interfaces.split_rule import ShardContext
from epl.sharding import collectives as C
from epl.sharding.linear import ColumnParallelLinear, RowParallelLinear, shard_linear
from epl.sharding.parameters import sharded_parameter
from epl.sharding.rules import is_linear_like

#: The torch calls a wrapped linear's forward may make for the example run to show it additive: products with the
#: weights, scaling, sums, casts and dropout (property reads show up as ``__get__``).
ADDITIVE_CALLS = frozenset(
    {"linear", "__get__", "mul", "__mul__", "__rmul__", "add", "__add__", "__radd__", "__iadd__", "add_", "to"}
    | {"dropout", "type", "float", "double", "half", "bfloat16", "contiguous"}
)
#: What a base layer holding its weight ``[in, out]`` adds to them (GPT-2's ``Conv1D``: the tokens viewed as rows,
#: ``addmm`` with the weight and the bias, viewed back).
IN_OUT_BASE_CALLS = frozenset({"size", "view", "addmm"})
#: The calls that are products with a weight.
PRODUCTS = ("linear", "addmm")


@dataclass(frozen=True)
class WrappedLinear:
    """A wrapped linear's parts: its base layer with its features, and its adapters by qualified name (readers,
    writers). Which way a linear-like base holds its weight, the example run shows (a square one either way)."""

    base: nn.Module
    readers: dict[str, nn.Linear]
    writers: dict[str, nn.Linear]
    in_features: int = 0
    out_features: int = 0


def wrapped_linear(module: nn.Module) -> WrappedLinear | None:
    """``module``'s parts when it is a wrapped linear (module docstring), else None."""
    base = getattr(module, "base_layer", None)
    if not isinstance(base, nn.Module) or next(module.parameters(recurse=False), None) is not None:
        return None
    if next(module.buffers(recurse=False), None) is not None:
        return None
    if isinstance(base, nn.Linear):
        return _adapters_of(module, base, base.in_features, base.out_features)
    if not is_linear_like(base) or any(True for _ in base.children()):
        return None
    rows, columns = base.get_parameter("weight").shape
    # the orientation under which every adapter reads the input or writes the output (a square base: either)
    return _adapters_of(module, base, columns, rows) or _adapters_of(module, base, rows, columns)


def _adapters_of(module: nn.Module, base: nn.Module, in_features: int, out_features: int) -> WrappedLinear | None:
    """``module``'s parts around ``base`` of these features, or None when an adapter is neither a reader nor a
    writer of them."""
    covered = {id(p) for p in base.parameters()}
    readers: dict[str, nn.Linear] = {}
    writers: dict[str, nn.Linear] = {}
    for name, child in module.named_modules():
        if child is base or name.startswith("base_layer.") or not isinstance(child, nn.Linear):
            continue
        if child.in_features == in_features and child.out_features != out_features:
            readers[name] = child
        elif child.out_features == out_features and child.in_features != in_features:
            writers[name] = child
        else:
            return None  # a square adapter or a shape of neither kind: no proof of which side it is on
        covered.update(id(p) for p in child.parameters())
    if any(id(p) not in covered for p in module.parameters()) or not readers or not writers:
        return None
    ranks = {r.out_features for r in readers.values()}
    if ranks != {w.in_features for w in writers.values()}:
        return None
    return WrappedLinear(base, readers, writers, in_features, out_features)


def additive(inner: list[str], wrapped: WrappedLinear) -> bool:
    """Whether the torch calls of one call of a wrapped linear (by name, as the example run recorded them) are the
    base's product and some adapters' (the active ones: a reader and a writer each at least, each adapter once),
    scaled, summed, cast and dropped out, and nothing else. A ``Conv1D`` base computes its product as
    ``addmm`` of the tokens viewed as rows (:data:`IN_OUT_BASE_CALLS`): a base of another type than ``nn.Linear``
    may, once."""
    linear_base = isinstance(wrapped.base, nn.Linear)
    allowed = ADDITIVE_CALLS if linear_base else ADDITIVE_CALLS | IN_OUT_BASE_CALLS
    products = sum(inner.count(name) for name in PRODUCTS)
    base_product_once = linear_base or inner.count("addmm") == 1
    return (
        set(inner) <= allowed and base_product_once and 3 <= products <= 1 + len(wrapped.readers) + len(wrapped.writers)
    )


class ShardedWriter(nn.Module):
    """A writer adapter of a column-parallel wrapped linear: this device's rows of its output, as the base's.

    Its input, whole on every device, enters with Megatron's *f* (identity forward, all-reduce of the gradient
    backward); its rows are cut as the base's output features are (by part for fused layers).
    """

    def __init__(self, linear: nn.Linear, shard: ShardContext) -> None:
        super().__init__()
        self.group = shard.group
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = sharded_parameter(linear.weight, group=self.group, dim=0, parts=shard.parts)
        bias = linear.bias
        self.bias = sharded_parameter(bias, group=self.group, dim=0, parts=shard.parts) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This device's output features."""
        return F.linear(C.copy_to_shards(x, self.group), self.weight, self.bias)

    def extra_repr(self) -> str:
        """What ``print(model)`` shows of this layer."""
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"(shard {self.group.index} of {self.group.count}: {self.weight.shape[0]}), adapter of a column layer"
        )


def shard_wrapped_linear(module: nn.Module, shard: ShardContext) -> nn.Module:
    """The split rule for wrapped linears: ``module`` with its base sharded by ``shard.role`` and its adapters
    following it (module docstring). The wrapper object is kept, so its own ``forward`` (PEFT's) still runs."""
    wrapped = wrapped_linear(module)
    if wrapped is None:  # the structure changed since the layout was decided
        raise AnnotationError(f"{shard.name}: no longer a wrapped linear layer (a base_layer and its adapters).")
    if shard.role in ("column", "row") and shard.group.batch_split:
        raise AnnotationError(
            f"{shard.name}: a wrapped linear layer (adapters on its base_layer) under a split whose devices also "
            "split the batch (colocated with a replicate TaskGraph) is not supported yet: create it outside the "
            "epl.split scope, or do not colocate."
        )
    role = "alone" if shard.role == "logits" else shard.role  # adapters' sum on sharded logits: not proven
    base_shard = replace(shard, name=f"{shard.name}.base_layer", role=role)
    if role == "column":
        _put(module, "base_layer", ColumnParallelLinear(wrapped.base, base_shard))
        for name, writer in wrapped.writers.items():
            _put(module, name, ShardedWriter(writer, replace(shard, name=f"{shard.name}.{name}")))
    elif role == "row":
        _put(module, "base_layer", RowParallelLinear(wrapped.base, base_shard))
        for name, reader in wrapped.readers.items():
            reader_shard = replace(shard, name=f"{shard.name}.{name}", role="row", weight_layout="out_in")
            _put(module, name, RowParallelLinear(reader, reader_shard))
    else:
        _put(module, "base_layer", shard_linear(wrapped.base, base_shard))
    return module


def _put(module: nn.Module, name: str, child: nn.Module) -> None:
    """Replace ``module``'s submodule ``name`` by ``child``."""
    parent, _, attr = name.rpartition(".")
    setattr(module.get_submodule(parent) if parent else module, attr, child)
