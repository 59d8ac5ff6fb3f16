"""Column/row pairs from a recorded forward pass: where a sharded activation may travel between two layers.

Megatron-LM shards attention and MLP blocks so that activations stay sharded from
the first linear layers (q/k/v, gate/up: *column* parallel) to the last (o, down:
*row* parallel), with one all-reduce at the end. This module finds such regions
in any model by following the outputs of the linear-like modules through the
recorded torch calls (:mod:`epl.sharding.dataflow`), tracking which dimension of
each tensor is sharded:

- views and reshapes move it (``[.., heads * head_dim]`` to ``[.., heads, head_dim]``
  shards whole heads: the column shards must hold whole heads, the *granule*);
- transposes, permutes, elementwise operations with whole tensors that broadcast
  over it, reductions and slices along other dimensions, batched matmuls and
  attention with it as a batch dimension keep it;
- a split or chunk along it marks a fused layer (GPT-2's ``c_attn``: q, k and v
  in one weight), each part sharded on its own; a literal split size is a whole
  size, noted so the module attribute it came from can be rescaled;
- anything else (a reduction over it, a mix with a whole tensor of its full size,
  an unknown operation) ends the region: those layers keep whole outputs.

A region pairs when it reaches exactly one candidate, with the sharded dimension
last and contiguous, and escapes nowhere else (not into the model's output).

A parameter used whole on a region's sharded activations (the weight of a norm applied
to each attention head, as Qwen3's ``q_norm``) gets from each device the gradient of
that device's shard only: the pairing lists it in ``partial_gradients``, so that its
gradient is summed over the devices. One also used outside the regions ends them.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch

from epl.sharding.dataflow import Dataflow, ModuleCall, Op, WeightLayout, tensors_in


@dataclass(frozen=True)
class Sharded:
    """A tensor of a region: the columns it derives from, its sharded dimension, features per index along it."""

    sources: frozenset[str]
    dim: int
    granule: Fraction | int = 1


#: A tensor an operation made, with where its shard lies: (sharded dimension, granule).
_Placed = tuple[torch.Tensor, tuple[int, Fraction | int]]


@dataclass
class ColumnFacts:
    """What a column module's region requires of its shards."""

    #: Parts of a fused output (split or chunked along the sharded dimension); each part is sharded on its own.
    parts: int = 1
    #: Column-output features that must stay together on one device (a head's dimension).
    granule: int = 1
    #: (module name, whole size) pairs: integer attributes the module's code uses as sizes of sharded tensors.
    fixups: set[tuple[str, int]] = field(default_factory=set)


@dataclass
class Pairing:
    """The decisions: columns with their facts, each row with the columns feeding it."""

    columns: dict[str, ColumnFacts] = field(default_factory=dict)
    rows: dict[str, frozenset[str]] = field(default_factory=dict)
    #: Candidates whose output is a model output read by nothing else (the logits, when it is the loss's input).
    outputs: set[str] = field(default_factory=set)
    #: Candidates whose input derives from the model's inputs (token embeddings, unlike position embeddings).
    input_fed: set[str] = field(default_factory=set)
    #: Linear-like candidates and how they hold their weights.
    weight_layouts: dict[str, WeightLayout] = field(default_factory=dict)
    #: Why a candidate's region did not pair (for messages).
    reasons: dict[str, str] = field(default_factory=dict)
    #: Parameters used whole on the sharded activations of paired regions -> those regions' columns: each
    #: device computes their gradient over its shard only, to be summed over the devices.
    partial_gradients: dict[str, frozenset[str]] = field(default_factory=dict)


class _Rejected(Exception):
    """An operation a sharded activation cannot go through."""


def find_pairs(flow: Dataflow) -> Pairing:
    """Column/row pairs in ``flow`` (see the module docstring)."""
    return _Analysis(flow).run()


class _Analysis:
    def __init__(self, flow: Dataflow) -> None:
        self.flow = flow
        self.layout: dict[int, Sharded] = {}
        self.bad: set[str] = set()
        self.facts: dict[str, ColumnFacts] = defaultdict(ColumnFacts)
        self.feeds: dict[str, set[str]] = defaultdict(set)
        self.calls: dict[str, int] = defaultdict(int)
        self.fed_rows: dict[str, set[str]] = defaultdict(set)
        self.order: list[str] = []
        self.read: set[int] = set()
        self.linear: set[str] = set()
        self.derived: set[int] = {id(t) for t in flow.inputs}
        self.input_fed: set[str] = set()
        self.weight_layouts: dict[str, WeightLayout] = {}
        #: Why each rejected column's region ended (for ``epl plan`` and error messages).
        self.reasons: dict[str, str] = {}
        #: id(tensor) -> the parameter it is, or was made from alone (``w.float()``, ``1 + w``).
        self.parameter_of: dict[int, str] = dict(flow.parameters)
        #: Parameter -> the columns of the regions whose sharded activations it is used on, whole.
        self.inside: dict[str, set[str]] = defaultdict(set)
        #: Parameters used outside every region.
        self.outside: set[str] = set()

    def run(self) -> Pairing:
        for event in self.flow.events:
            if isinstance(event, ModuleCall):
                self._module_call(event)
            else:
                self._op(event)
        for tensor in self.flow.outputs:
            if id(tensor) in self.layout:
                self.bad |= self.layout[id(tensor)].sources
        return self._decide()

    def _module_call(self, call: ModuleCall) -> None:
        self.calls[call.name] += 1
        if call.weight_layout is not None:
            self.linear.add(call.name)
            self.weight_layouts[call.name] = call.weight_layout
        if any(id(t) in self.derived for t in call.inputs):
            self.input_fed.add(call.name)
            self.derived.update(id(t) for t in call.outputs)
        if call.name not in self.order:
            self.order.append(call.name)
        for tensor in call.inputs:
            self.read.add(id(tensor))
            if id(tensor) in self.parameter_of:
                self.outside.add(self.parameter_of[id(tensor)])
            found = self.layout.get(id(tensor))
            if found is None:
                continue
            self.feeds[call.name] |= found.sources
            for source in found.sources:
                self.fed_rows[source].add(call.name)
            # The row layer's input features are this device's in order: one per column feature (granule 1), or
            # fewer, when the region dropped some of each whole unit (Falcon's fused q/k/v: the keys and values of
            # each group leave, its queries reach the output projection). Duplicated features (granule < 1) are not.
            if found.dim != tensor.dim() - 1 or found.granule < 1 or len(call.inputs) != 1:
                self.bad |= found.sources
        for tensor in call.outputs:
            self.layout[id(tensor)] = Sharded(frozenset({call.name}), tensor.dim() - 1)

    def _op(self, op: Op) -> None:
        inputs = list(tensors_in((op.args, op.kwargs)))
        self.read.update(id(t) for t in inputs)
        if any(id(t) in self.derived for t in inputs):
            self.derived.update(id(t) for t in tensors_in(op.result))
        sharded = [self.layout[id(t)] for t in inputs if id(t) in self.layout]
        parameters = {self.parameter_of[id(t)] for t in inputs if id(t) in self.parameter_of}
        if not sharded:
            if len(parameters) == 1 and all(id(t) in self.parameter_of for t in inputs):
                self.parameter_of.update(dict.fromkeys(map(id, tensors_in(op.result)), parameters.pop()))
            else:
                self.outside |= parameters
            return
        sources = frozenset().union(*(s.sources for s in sharded))
        try:
            results = _propagate_checked(op, self.layout, self.facts)
        except _Rejected as rejected:
            for source in sources - self.bad:
                self.reasons[source] = f"{rejected} (in {op.module or 'the model'}: {_name(op.func)})"
            self.bad |= sources
            self.outside |= parameters  # the region's layers keep whole outputs: a whole use
            return
        for parameter in parameters:
            self.inside[parameter] |= sources
        for tensor, (dim, granule) in results:
            self.layout[id(tensor)] = Sharded(sources, dim, granule)
            for source in sources:
                facts = self.facts[source]
                if Fraction(granule).denominator == 1:
                    facts.granule = math.lcm(facts.granule, int(granule))

    def _decide(self) -> Pairing:
        for parameter in self.outside & self.inside.keys():
            # Its gradient would be partly per device, partly whole: no sum over the devices fixes both.
            for source in self.inside[parameter] - self.bad:
                self.reasons[source] = f"the parameter {parameter} is used on the sharded activations and elsewhere"
            self.bad |= self.inside[parameter]
        pairing = Pairing(input_fed=self.input_fed, weight_layouts=self.weight_layouts, reasons=self.reasons)
        taken: set[str] = set()
        for name in self.order:
            columns = self.feeds.get(name)
            if not columns or name in taken or columns & taken or self.calls[name] != 1:
                continue
            if name not in self.linear or not columns <= self.linear or columns & self.bad:
                continue
            if any(self.calls[c] != 1 or self.fed_rows[c] != {name} for c in columns):
                continue
            pairing.rows[name] = frozenset(columns)
            for column in columns:
                pairing.columns[column] = self.facts[column]
            taken |= columns | {name}
        outputs = {id(t) for t in self.flow.outputs}
        for event in self.flow.events:
            if isinstance(event, ModuleCall) and event.name not in taken and self.calls[event.name] == 1:
                if event.outputs and all(id(t) in outputs and id(t) not in self.read for t in event.outputs):
                    pairing.outputs.add(event.name)
        for parameter, columns in self.inside.items():
            if paired := frozenset(columns & pairing.columns.keys()):
                pairing.partial_gradients[parameter] = paired
        return pairing


# --- how one operation moves the sharded dimension ----------------------------------------------------------------

_VIEWS = {"view", "reshape", "flatten", "unflatten", "view_as", "reshape_as"}
_TRANSPOSES = {"transpose", "swapaxes", "swapdims"}
_REDUCTIONS = {
    "sum",
    "mean",
    "amax",
    "amin",
    "norm",
    "var",
    "std",
    "logsumexp",
    "softmax",
    "log_softmax",
    "cumsum",
    "max",
    "min",
    "argmax",
    "argmin",
    "prod",
    "all",
    "any",
    "topk",
    "sort",
    "argsort",
}
_MATMULS = {"matmul", "bmm", "__matmul__", "__rmatmul__"}
_COMPLEX_VIEWS = {"view_as_complex", "view_as_real"}
_REJECT = {"__setitem__", "gather", "scatter", "index_select", "take", "masked_scatter", "einsum", "baddbmm", "roll"}


def _name(func: Any) -> str:
    return getattr(func, "__name__", "") or ""


def _propagate_checked(op: Op, layout: dict[int, Sharded], facts: dict[str, ColumnFacts]) -> list[_Placed]:
    """:func:`_propagate`, with any failure to follow the operation (shapes it does not expect) a rejection."""
    try:
        return _propagate(op, layout, facts)
    except _Rejected:
        raise
    except Exception as error:  # noqa: BLE001 - an operation the rules do not cover ends the region
        raise _Rejected(f"{_name(op.func)} cannot be followed ({type(error).__name__})") from error


def _propagate(op: Op, layout: dict[int, Sharded], facts: dict[str, ColumnFacts]) -> list[_Placed]:
    """(output tensor, (sharded dim, granule)) for each tensor ``op`` made; raises _Rejected."""
    name = _name(op.func)
    outputs = list(tensors_in(op.result))
    first = op.args[0] if op.args else None
    if name in _REJECT:
        raise _Rejected(name)
    if name == "scaled_dot_product_attention":
        return _attention(op, layout, outputs)
    if name in _MATMULS:
        return _batched(op, layout, outputs)
    if name in ("cat", "concat", "concatenate", "stack"):
        return _concatenate(op, layout, outputs, stack=name == "stack")
    if not isinstance(first, torch.Tensor) or id(first) not in layout:
        return _broadcast(op, layout, outputs)  # e.g. ``1 + x`` as torch.add(1, x) or a whole first operand
    here = layout[id(first)]
    dim, granule = here.dim, here.granule
    if name in _COMPLEX_VIEWS:  # pairs of reals as complex numbers and back: the last dim changes
        if dim >= first.dim() - 1:
            raise _Rejected(f"{name} of the sharded dimension")
        return [(outputs[0], (dim, granule))]
    if name in _VIEWS:
        moved = [(out, _reshaped(first.shape, out.shape, dim, granule)) for out in outputs]
        if name in ("view", "reshape") and any(_names_size(op, out_dim) for _, (out_dim, _) in moved):
            # ``x.view(batch, self.num_heads, -1, ...)``: a count the module keeps, which a shard no longer matches.
            raise _Rejected("a view names the size of the sharded dimension (a count the module keeps, as num_heads)")
        return moved
    if name in _TRANSPOSES:
        a, b = (_dim_arg(op, i, first.dim()) for i in (1, 2))
        return [(outputs[0], ({a: b, b: a}.get(dim, dim), granule))]
    if name == "permute":
        order = _int_list(op.args[1:]) if len(op.args) > 1 else list(op.kwargs["dims"])
        order = [d % first.dim() for d in order]
        return [(outputs[0], (order.index(dim), granule))]
    if name == "movedim":
        return [(outputs[0], (_moved(first.dim(), op, dim), granule))]
    if name in ("unsqueeze", "squeeze", "expand", "expand_as", "broadcast_to", "__getitem__", "narrow", "select"):
        return [(outputs[0], (_aligned_by_shape(op, first, outputs[0], dim), granule))]
    if name in ("split", "chunk", "tensor_split", "unbind", "split_with_sizes"):
        return _split(op, here, first, outputs, facts)
    if name in _REDUCTIONS:
        dims = _reduced_dims(op, first.dim())
        if dims is None or dim in dims:
            raise _Rejected(f"{name} over the sharded dimension")
        return [(out, (_after_reduction(first, out, dim, dims), granule)) for out in outputs if out.is_floating_point()]
    return _broadcast(op, layout, outputs)


def _names_size(op: Op, dim: int) -> bool:
    """Whether a view or reshape gives output dimension ``dim`` (the sharded one) a size a shard may not match.

    A number there is safe when it comes from tensors' shapes (``reshape(batch, kv_heads * n_rep, ...)`` in
    ``repeat_kv``, ``x.reshape(*x.shape[:-1], -1, 2)``): it shrinks with the shard. One the module keeps
    (``self.num_heads``) does not, and a -1 elsewhere would absorb the difference silently. So a number at the
    sharded dimension is refused when the line that made the call reads an attribute (``self.``), or when it
    equals an integer attribute of the object whose method made the call (``h = self.num_heads``).
    """
    given = op.args[1:] if len(op.args) > 1 else (op.kwargs.get("shape") or op.kwargs.get("size") or ())
    if len(given) == 1 and isinstance(given[0], (list, tuple, torch.Size)):
        given = tuple(given[0])
    if not given or not all(isinstance(size, int) for size in given) or dim >= len(given) or given[dim] == -1:
        return False  # view(dtype), view_as, or -1 there: no size of its own
    return "self." in op.line or given[dim] in op.counts


def _int_list(values: Sequence[Any]) -> list[int]:
    if len(values) == 1 and isinstance(values[0], (list, tuple, torch.Size)):
        return [int(v) for v in values[0]]
    return [int(v) for v in values]


def _dim_arg(op: Op, index: int, ndim: int) -> int:
    names = {1: ("dim0", "dim"), 2: ("dim1",)}[index]
    value = op.args[index] if len(op.args) > index else next(op.kwargs[n] for n in names if n in op.kwargs)
    return int(value) % ndim


def _moved(ndim: int, op: Op, dim: int) -> int:
    source = op.args[1] if len(op.args) > 1 else op.kwargs["source"]
    target = op.args[2] if len(op.args) > 2 else op.kwargs["destination"]
    sources = [s % ndim for s in (source if isinstance(source, (list, tuple)) else [source])]
    targets = [t % ndim for t in (target if isinstance(target, (list, tuple)) else [target])]
    order = [d for d in range(ndim) if d not in sources]
    for s, t in sorted(zip(targets, sources, strict=True)):
        order.insert(s, t)
    return order.index(dim)


def _reshaped(
    before: Sequence[int], after: Sequence[int], dim: int, granule: Fraction | int
) -> tuple[int, Fraction | int]:
    """Where dimension ``dim`` of ``before`` goes in ``after``: it may be split (outer part sharded) or merged."""
    before, after = list(before), list(after)
    i = j = 0
    while i < len(before) or j < len(after):
        start_i, start_j = i, j
        size_i = before[i] if i < len(before) else 1
        size_j = after[j] if j < len(after) else 1
        i, j = i + 1, j + 1
        while size_i != size_j:
            if size_i < size_j:
                size_i *= before[i]
                i += 1
            else:
                size_j *= after[j]
                j += 1
        if start_i <= dim < i:
            group_in, group_out = before[start_i:i], after[start_j:j]
            # The sharded dim must be the outermost non-1 dim of its group, before and after.
            if any(s != 1 for s in group_in[: dim - start_i]):
                raise _Rejected("reshape mixes the sharded dimension with an outer one")
            inner = math.prod(group_in[dim - start_i + 1 :])
            k = next((k for k, s in enumerate(group_out) if s != 1), None)
            if k is None:
                raise _Rejected("reshape drops the sharded dimension")
            # Column features per index of the new sharded dim (a fraction after an expand duplicated them).
            return start_j + k, Fraction(granule) * math.prod(group_out[k + 1 :]) / inner
    raise _Rejected("reshape lost the sharded dimension")


def _aligned_by_shape(op: Op, first: torch.Tensor, out: torch.Tensor, dim: int) -> int:
    """The sharded dim after an op that keeps it (size unchanged) while adding or removing other dims."""
    name = _name(op.func)
    if name == "unsqueeze":
        at = int(op.args[1] if len(op.args) > 1 else op.kwargs["dim"]) % out.dim()
        return dim + 1 if at <= dim else dim
    if name in ("expand", "expand_as", "broadcast_to"):
        moved = dim + out.dim() - first.dim()
        if out.shape[moved] != first.shape[dim]:
            raise _Rejected("expand of the sharded dimension")
        return moved
    if name == "squeeze":
        kept = [d for d in range(first.dim()) if first.shape[d] != 1 or d == dim]
        if first.shape[dim] == 1 or len(kept) != out.dim():
            raise _Rejected("squeeze around the sharded dimension")
        return kept.index(dim)
    if name in ("narrow", "select"):
        along = int(op.args[1] if len(op.args) > 1 else op.kwargs["dim"]) % first.dim()
        if along == dim:
            raise _Rejected("slice of the sharded dimension")
        return dim if name == "narrow" or along > dim else dim - 1
    return _indexed(op.args[1], first, dim)


def _indexed(index: Any, first: torch.Tensor, dim: int) -> int:
    """The sharded dim after ``first[index]`` (slicing the sharded dim is rejected).

    Basic indexing, and one list (or 1-D integer tensor) of positions in another dimension, which
    keeps that dimension where it is (Falcon's ``qkv[:, :, :, [-2]]`` picks the key of each group).
    """
    items = list(index) if isinstance(index, tuple) else [index]
    advanced = [i for i, item in enumerate(items) if isinstance(item, (torch.Tensor, list))]
    if len(advanced) > 1 or any(not _positions(items[i]) for i in advanced):
        raise _Rejected("advanced indexing")
    items = [slice(0, 0) if i in advanced else item for i, item in enumerate(items)]
    used = sum(1 for item in items if item is not None and item is not Ellipsis)
    expanded: list[Any] = []
    for item in items:
        if item is Ellipsis:
            expanded.extend([slice(None)] * (first.dim() - used))
        else:
            expanded.append(item)
    expanded.extend([slice(None)] * (first.dim() - sum(1 for i in expanded if i is not None)))
    source = out = 0
    for item in expanded:
        if item is None:
            out += 1
            continue
        if source == dim:
            if not (isinstance(item, slice) and item == slice(None)):
                raise _Rejected("index of the sharded dimension")
            return out
        source += 1
        if not isinstance(item, int):
            out += 1
    raise _Rejected("index lost the sharded dimension")


def _positions(item: Any) -> bool:
    """Whether ``item`` is a 1-D list of integer positions (a list of ints, or an integer tensor of one dim)."""
    if isinstance(item, list):
        return all(type(value) is int for value in item)
    return item.dim() == 1 and not item.dtype.is_floating_point and item.dtype != torch.bool


def _split(
    op: Op, here: Sharded, first: torch.Tensor, outputs: list[torch.Tensor], facts: dict[str, ColumnFacts]
) -> list[_Placed]:
    name = _name(op.func)
    if name == "unbind":
        raise _Rejected("unbind")
    default = 0
    along = op.args[2] if len(op.args) > 2 else op.kwargs.get("dim", default)
    along = int(along) % first.dim()
    if along != here.dim:
        return [(out, (here.dim, here.granule)) for out in outputs]
    sizes = {out.shape[along] for out in outputs}
    if len(sizes) != 1 or here.granule != 1:
        raise _Rejected("uneven split of the sharded dimension")
    size = op.args[1] if len(op.args) > 1 else op.kwargs.get("split_size_or_sections", op.kwargs.get("chunks"))
    for source in here.sources:
        facts[source].parts *= len(outputs)
        if name == "split" and isinstance(size, int):
            facts[source].fixups.add((op.module, size))
        elif name != "chunk":
            raise _Rejected("split sizes given as a list")
    return [(out, (here.dim, 1)) for out in outputs]


def _reduced_dims(op: Op, ndim: int) -> set[int] | None:
    value = op.args[1] if len(op.args) > 1 else op.kwargs.get("dim")
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return {int(v) % ndim for v in value}
    if not isinstance(value, int):
        return None
    return {value % ndim}


def _after_reduction(first: torch.Tensor, out: torch.Tensor, dim: int, dims: set[int]) -> int:
    if out.dim() == first.dim():
        return dim
    return dim - sum(1 for d in dims if d < dim)


def _broadcast(op: Op, layout: dict[int, Sharded], outputs: list[torch.Tensor]) -> list[_Placed]:
    """An elementwise operation: outputs have the broadcast shape; whole operands broadcast over the shard."""
    inputs = list(tensors_in((op.args, op.kwargs)))
    if not outputs:
        return []
    rank = outputs[0].dim()
    shape = torch.broadcast_shapes(*(t.shape for t in inputs))
    if any(out.shape != shape for out in outputs):
        raise _Rejected(f"{_name(op.func)} changes the shape")
    from_end = {layout[id(t)].dim - t.dim() for t in inputs if id(t) in layout}
    granules = {layout[id(t)].granule for t in inputs if id(t) in layout}
    if len(from_end) != 1 or len(granules) != 1:
        raise _Rejected("operands sharded along different dimensions")
    (offset,) = from_end
    for tensor in inputs:
        if id(tensor) not in layout and tensor.dim() >= -offset and tensor.shape[offset] != 1:
            raise _Rejected("a whole operand spans the sharded dimension")
    (granule,) = granules
    return [(out, (rank + offset, granule)) for out in outputs]


def _batched(op: Op, layout: dict[int, Sharded], outputs: list[torch.Tensor]) -> list[_Placed]:
    """A batched matrix product: the sharded dimension must be a batch dimension of every sharded operand."""
    a, b = (t for t in list(tensors_in(op.args))[:2])
    out = outputs[0]
    offsets = set()
    granule: Fraction | int = 1
    for tensor in (a, b):
        if id(tensor) in layout:
            found = layout[id(tensor)]
            if found.dim >= tensor.dim() - 2:
                raise _Rejected("matmul over the sharded dimension")
            offsets.add(found.dim - tensor.dim())
            granule = found.granule
    if len(offsets) != 1:
        raise _Rejected("matmul operands sharded differently")
    (offset,) = offsets
    for tensor in (a, b):
        if id(tensor) not in layout and tensor.dim() >= -offset and tensor.shape[offset] != 1:
            raise _Rejected("a whole matmul operand spans the sharded dimension")
    return [(out, (out.dim() + offset, granule))]


def _attention(op: Op, layout: dict[int, Sharded], outputs: list[torch.Tensor]) -> list[_Placed]:
    """``scaled_dot_product_attention``: heads (dimension -3) sharded on q, k and v; a mask broadcast over them."""
    q, k, v = (op.args + tuple(op.kwargs[n] for n in ("query", "key", "value") if n in op.kwargs))[:3]
    granules = set()
    for tensor in (q, k, v):
        found = layout.get(id(tensor))
        if found is None or found.dim != tensor.dim() - 3:
            raise _Rejected("attention with whole or differently sharded q, k, v")
        granules.add(found.granule)
    mask = op.args[3] if len(op.args) > 3 else op.kwargs.get("attn_mask")
    if isinstance(mask, torch.Tensor) and id(mask) not in layout and mask.dim() >= 3 and mask.shape[-3] != 1:
        raise _Rejected("an attention mask per head")
    out = outputs[0]
    return [(out, (out.dim() - 3, max(granules)))]


def _concatenate(op: Op, layout: dict[int, Sharded], outputs: list[torch.Tensor], *, stack: bool) -> list[_Placed]:
    tensors = list(tensors_in(op.args[0] if op.args else op.kwargs["tensors"]))
    if any(id(t) not in layout for t in tensors):
        raise _Rejected("concatenation of sharded and whole tensors")
    dims = {layout[id(t)].dim for t in tensors}
    granules = {layout[id(t)].granule for t in tensors}
    if len(dims) != 1 or len(granules) != 1:
        raise _Rejected("concatenation of differently sharded tensors")
    (dim,) = dims
    along = op.args[1] if len(op.args) > 1 else op.kwargs.get("dim", 0)
    along = int(along) % (tensors[0].dim() + (1 if stack else 0))
    if not stack and along == dim:
        raise _Rejected("concatenation along the sharded dimension")
    new_dim = dim + 1 if stack and along <= dim else dim
    return [(outputs[0], (new_dim, granules.pop()))]
