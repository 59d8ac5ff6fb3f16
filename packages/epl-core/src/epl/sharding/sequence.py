"""Sequence parallelism inside a split region (``split.sequence_parallel``): Megatron-LM's, at module boundaries.

Between the stack's blocks the residual stream holds ``s/t`` tokens on each device:

- the first block's input is cut along the sequence (backward: all-gathered);
- each region (the module that calls a column/row pair: ``self_attn``, ``mlp``) all-gathers its input along the
  sequence (backward: reduce-scatter), so attention sees the whole sequence as today; its column layers take
  the gathered input as it is;
- the region's row layer reduce-scatters along the sequence instead of all-reducing;
- the last block's output is all-gathered, so the final norm, the head and the loss run as today;
- every whole parameter inside the blocks (norms, row biases) has its gradient summed over the shard group.

Before any hook goes in, :func:`prove_token_wise` reads the example run's record (the one the split layout is
decided from) and refuses a model whose blocks do, outside their attention and MLP, anything that is not done
token by token: a view or a transpose of the stream, a reduction over the tokens, a whole tensor that spans the
sequence, a layer that reads the stream, or a region whose gathered input reaches anything but its column layers.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from epl.errors import AnnotationError
from epl.interfaces.shard_group import ShardGroup
from epl.sharding import collectives as C
from epl.sharding.dataflow import Dataflow, ModuleCall, Op, Span, tensors_in
from epl.sharding.linear import RowParallelLinear
from epl.sharding.links import tracing
from epl.sharding.parameters import is_sharded
from epl.torch_private import saved_tensor_hooks_active

SEQUENCE_DIM = 1  # [batch, sequence, hidden]
BATCH_SPLIT_REFUSED = (
    "split.sequence_parallel shares each sequence's tokens among the devices of a split, but here those devices "
    "already split the batch between them (replicate and split colocated, cluster.colocate_split_and_replicate). "
    "Use one or the other."
)


def install(model: nn.Module, group: ShardGroup, summed: set[int]) -> list[Any]:
    """Put the hooks of sequence parallelism on ``model``'s stack of blocks; the handles. ``summed``: ids of
    parameters whose gradient is summed over the group already."""
    if group.batch_split:
        raise AnnotationError(BATCH_SPLIT_REFUSED)
    rows = [module for module in model.modules() if isinstance(module, RowParallelLinear) and module.group is group]
    stack = _stack_of(model, rows)
    group.sequence_dim = SEQUENCE_DIM
    handles: list[Any] = []
    blocks = list(stack)
    handles.append(blocks[0].register_forward_pre_hook(_on_stream(_cut(group)), with_kwargs=True))
    handles.append(blocks[-1].register_forward_hook(_gather_output(group)))
    regions = {id(parent): parent for parent in _parents(model, rows)}
    for index, block in enumerate(blocks):
        _check_token_wise(block, regions, f"the block {index} of the stack")
    if group.random is not None:  # each device's tokens draw their own dropout masks, on every pipeline stage
        for block in blocks:
            handles.append(block.register_forward_pre_hook(lambda module, args: group.random.enter()))
    for region in regions.values():
        handles.append(region.register_forward_pre_hook(_enter_region(group), with_kwargs=True))
        # Not always_call: a compiled block would guard on each region's hook id, and compile once per block. A
        # forward that raises is cleaned up by default_random_after, the forward context, instead.
        handles.append(region.register_forward_hook(_leave_region(group)))
    for block in blocks:
        for parameter in block.parameters():
            if not is_sharded(parameter) and parameter.requires_grad and id(parameter) not in summed:
                C.sum_gradient_over_shards(parameter, group)
                summed.add(id(parameter))
    return handles


@contextlib.contextmanager
def default_random_after(groups: list[ShardGroup]) -> Iterator[None]:
    """A forward context: the default random state is back when a forward ends, also a pipeline stage's that
    holds blocks but not the last one (whose final gather leaves the region's state); and no region is left
    open by a forward that raised inside one (its saved-tensor hooks left, its depth back to 0)."""
    try:
        yield
    finally:
        for group in groups:
            if group.random is not None:
                group.random.leave()
            group.sequence_depth, group.sequence_entry = 0, None
        while _saving:
            for entered in reversed(_saving.popitem()[1]):
                entered.__exit__(None, None, None)


def _cut(group: ShardGroup) -> Any:
    def cut(x: torch.Tensor) -> torch.Tensor:
        length = x.shape[SEQUENCE_DIM]
        if length % group.count:
            raise AnnotationError(
                f"split.sequence_parallel shares each sequence's tokens equally among the {group.count} devices of "
                f"a split: {length} tokens do not divide. Pad the sequences to a multiple of {group.count}."
            )
        return C.split_to_shards(x, group, SEQUENCE_DIM, group.sizes(length))

    return cut


def _check_token_wise(block: nn.Module, regions: dict[int, nn.Module], where: str) -> None:
    """Refuse a block holding anything but regions, norms and dropouts: under sequence parallelism the rest of a
    block runs on each device's tokens only, which is right only for work done token by token."""
    for name, child in block.named_children():
        if id(child) in regions or isinstance(child, nn.Dropout) or _is_norm(child):
            continue
        if not any(True for _ in child.parameters()) and not list(child.children()):
            continue  # an activation or a parameterless helper: token-wise in the blocks EPL knows
        raise AnnotationError(
            f"split.sequence_parallel runs {where} on each device's share of the tokens, outside its attention "
            f"and MLP, but it holds {name!r} ({type(child).__name__}), which EPL cannot prove works token by "
            "token. Set split.sequence_parallel to False for this model."
        )


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm | nn.RMSNorm) or type(module).__name__.endswith(("Norm", "RMSNorm"))


def _stack_of(model: nn.Module, rows: Sequence[nn.Module]) -> nn.ModuleList:
    """The ``ModuleList`` whose items hold every row layer of the group."""
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            inside = {id(m) for block in module for m in block.modules()}
            if rows and all(id(row) in inside for row in rows):
                return module
    raise AnnotationError(
        "split.sequence_parallel needs the split layers in one list of blocks (a transformer's layers); "
        "this model has none. Set split.sequence_parallel to False."
    )


def _parents(model: nn.Module, rows: Sequence[nn.Module]) -> list[nn.Module]:
    wanted = {id(row) for row in rows}
    return [module for module in model.modules() if any(id(child) in wanted for child in module.children())]


def _on_stream(change: Any) -> Any:
    """A pre-hook applying ``change`` to a block's hidden states (its first argument, or ``hidden_states``)."""

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        if args:
            return (change(args[0]), *args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": change(kwargs["hidden_states"])}
        raise AnnotationError(f"{type(module).__name__} was called without its hidden states as first argument.")

    return hook


def _enter_region(group: ShardGroup) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        group.sequence_depth += 1
        saving: list[Any] = []

        def gather(x: torch.Tensor) -> torch.Tensor:
            whole = C.gather_rows(x, group, SEQUENCE_DIM)
            if tracing(group):
                # traced: the tensor itself (no weak reference in a graph); what the graph saves is its own choice
                group.sequence_entry = whole
                return whole
            group.sequence_entry = weakref.ref(whole)
            # saved-tensor hooks active already (checkpointing's, offloading's) own what is saved; True where torch
            # cannot say, and the gathered input is then kept whole
            if torch.is_grad_enabled() and not saved_tensor_hooks_active():
                saving.append(torch.autograd.graph.saved_tensors_hooks(*SavedAsShare(group, x, whole).hooks()))
                saving[-1].__enter__()
            return whole

        changed = _on_stream(gather)(module, args, kwargs)
        if saving:  # none in a compiled block (no guard there on the region's id)
            _saving[id(module)] = saving
        return changed

    return hook


#: The saved-tensor hooks each running region entered (by ``id`` of the region), left by its forward hook.
_saving: dict[int, list[Any]] = {}


def _leave_region(group: ShardGroup) -> Any:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        group.sequence_depth -= 1
        group.sequence_entry = None
        for entered in reversed(_saving.pop(id(module), []) if _saving else []):
            entered.__exit__(None, None, None)

    return hook


class SavedAsShare:
    """What a region's column layers save of its gathered input: this device's share, gathered again when the
    backward pass first needs it (Megatron-LM's sequence-parallel linear layers do the same), so a device keeps
    ``s/t`` tokens of it between forward and backward instead of ``s``."""

    def __init__(self, group: ShardGroup, share: torch.Tensor, whole: torch.Tensor) -> None:
        self.group, self.share = group, share.detach()
        self.storage, self.numel = whole.untyped_storage().data_ptr(), whole.numel()
        self.pending = 0
        self.regathered: torch.Tensor | None = None

    def hooks(self) -> tuple[Any, Any]:
        """``(pack, unpack)`` for ``torch.autograd.graph.saved_tensors_hooks``."""
        return self.pack, self.unpack

    def pack(self, tensor: torch.Tensor) -> Any:
        """The gathered input (or a view of all of it, as Conv1D's ``x.view(-1, nx)``) as a marker; else itself."""
        if tensor.untyped_storage().data_ptr() != self.storage or tensor.numel() != self.numel:
            return tensor
        self.pending += 1
        return (self, tensor.shape, tensor.stride(), tensor.storage_offset())

    def unpack(self, packed: Any) -> torch.Tensor:
        """The saved tensor; the gathered input is gathered again from the shares (once for all its uses)."""
        if not (isinstance(packed, tuple) and len(packed) == 4 and packed[0] is self):
            return packed
        _, shape, stride, offset = packed
        if self.regathered is None:
            with torch.no_grad():
                self.regathered = C.regather(self.share, self.group, SEQUENCE_DIM)
        whole = self.regathered
        self.pending = max(self.pending - 1, 0)
        if self.pending == 0:
            self.regathered = None
        return whole.as_strided(shape, stride, offset)


def _gather_output(group: ShardGroup) -> Any:
    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        local = output[0] if isinstance(output, tuple) else output
        if group.random is not None:
            group.random.leave()
        sizes = [local.shape[SEQUENCE_DIM]] * group.count
        whole = C.gather_from_shards(local, group, SEQUENCE_DIM, sizes)
        return (whole, *output[1:]) if isinstance(output, tuple) else whole

    return hook


#: Torch calls that work on each token alone, whatever their operands' other dimensions (checked separately).
TOKEN_WISE = frozenset(
    "add sub mul div true_divide neg pow rsqrt sqrt exp log tanh sigmoid relu gelu silu softplus erf abs square "
    "clamp clip where masked_fill dropout to type_as float half bfloat16 double clone contiguous detach "
    "__add__ __radd__ __iadd__ __sub__ __rsub__ __isub__ __mul__ __rmul__ __imul__ __truediv__ __rtruediv__ "
    "__itruediv__ __pow__ __neg__ add_ mul_ sub_ div_".split()
)
#: Reductions: token-wise when over the last dimension only.
OVER_LAST = frozenset("mean sum var std amax amin softmax log_softmax logsumexp norm".split())
#: Normalisations over the trailing dimension(s) named by their second argument.
NORMALISATIONS = frozenset({"layer_norm", "rms_norm"})


def prove_token_wise(flow: Dataflow, model: nn.Module, rows: set[str], columns: set[str]) -> None:
    """Refuse (:class:`AnnotationError`) a model whose blocks, between their regions, do anything but token-wise
    work on the residual stream, as the example run ``flow`` recorded it; ``rows``/``columns``: the names of the
    row and column layers."""
    modules = dict(model.named_modules())
    stack = _stack_of(model, [modules[name] for name in rows])
    stack_name = next(name for name, module in modules.items() if module is stack)
    blocks = [f"{stack_name}.{index}" if stack_name else str(index) for index in range(len(stack))]
    regions = {name.rpartition(".")[0] for name in rows}
    spans: dict[str, list[Span]] = {}
    for span in flow.spans:
        spans.setdefault(span.name, []).append(span)
    previous: torch.Tensor | None = None
    for block in blocks:
        if not any(row.startswith(f"{block}.") for row in rows):  # another pipeline stage's: not split here
            previous = None
            continue
        calls = spans.get(block, [])
        if len(calls) != 1 or not calls[0].inputs:
            raise _refusal(block, f"the example run called it {len(calls)} times (sequence parallelism needs once)")
        call = calls[0]
        if previous is not None and call.inputs[0] is not previous:
            raise _refusal(block, "its first argument is not the previous block's output")
        previous = _walk_block(flow, call, [s for s in flow.spans if s.name in regions], rows, columns)


def _walk_block(flow: Dataflow, block: Span, regions: list[Span], rows: set[str], columns: set[str]) -> torch.Tensor:
    """Follow the stream through ``block``'s events; its output (the next block's stream)."""
    stream = {id(block.inputs[0])}
    shape = block.inputs[0].shape
    inside = sorted((r for r in regions if block.start <= r.start and r.end <= block.end), key=lambda r: r.start)
    index = block.start
    while index < block.end:
        region = next((r for r in inside if r.start == index), None)
        if region is not None and region.end > region.start:
            stream |= _walk_region(flow, region, stream, (rows, columns), shape)
            index = region.end
            continue
        event = flow.events[index]
        index += 1
        if isinstance(event, ModuleCall):
            if any(id(t) in stream for t in event.inputs):
                raise _refusal(block.name, f"the layer {event.name!r} reads the tokens outside an attention or MLP")
            continue
        stream |= _token_wise(event, stream, shape, block.name)
    if not block.outputs or id(block.outputs[0]) not in stream:
        raise _refusal(block.name, "its output is not computed from its input token by token")
    for extra in block.outputs[1:]:
        if id(extra) in stream:
            raise _refusal(block.name, "it returns a second tensor computed from the tokens")
    return block.outputs[0]


def _walk_region(
    flow: Dataflow, region: Span, stream: set[int], layers: tuple[set[str], set[str]], shape: torch.Size
) -> set[int]:
    """Check a region: its gathered input reaches its column layers only; after its row layer, token-wise work.
    The ids of its outputs computed from the row layer's output (this device's tokens)."""
    rows, columns = layers
    if not region.inputs or id(region.inputs[0]) not in stream:
        raise _refusal(region.name, "its first argument is not the block's stream")
    gathered = region.inputs[0]
    local: set[int] = set()
    for event in flow.events[region.start : region.end]:
        if isinstance(event, ModuleCall):
            if any(t is region.inputs[0] for t in event.inputs) and event.name not in columns:
                raise _refusal(region.name, f"its input reaches the layer {event.name!r}, which is not column-parallel")
            if event.name in rows:
                local |= {id(t) for t in event.outputs}
            elif any(id(t) in local for t in event.inputs):
                raise _refusal(region.name, f"the layer {event.name!r} reads the row layer's output")
            continue
        operands = list(tensors_in((event.args, event.kwargs)))
        if any(t is gathered for t in operands) and any(True for _ in tensors_in(event.result)):
            raise _refusal(
                region.name,
                f"its input reaches {_describe(event)} besides its column layers (each device would count that "
                "use's gradient once more)",
            )
        if any(id(t) in local for t in operands):
            local |= _token_wise(event, local, shape, region.name)
    return {id(t) for t in region.outputs if id(t) in local}


def _token_wise(op: Op, stream: set[int], shape: torch.Size, where: str) -> set[int]:
    """The ids of ``op``'s results when it is token-wise on the stream tensors among its operands; else refuse."""
    operands = list(tensors_in((op.args, op.kwargs)))
    results = list(tensors_in(op.result))
    if not results or not any(id(t) in stream for t in operands):
        return set()
    name = getattr(op.func, "__name__", str(op.func))
    source = next(t for t in operands if id(t) in stream)
    if name in OVER_LAST:
        dim = op.kwargs.get("dim", op.args[1] if len(op.args) > 1 else None)
        dims = dim if isinstance(dim, tuple | list) else (dim,)
        if any(not isinstance(d, int) or d % source.dim() != source.dim() - 1 for d in dims):
            raise _refusal(where, f"{_describe(op)} reduces over the tokens or over several dimensions")
    elif name in NORMALISATIONS:
        normalized = op.args[1] if len(op.args) > 1 else op.kwargs.get("normalized_shape", ())
        if len(tuple(normalized)) != 1:
            raise _refusal(where, f"{_describe(op)} normalises over more than the last dimension")
    elif name not in TOKEN_WISE:
        raise _refusal(where, f"{_describe(op)} is not known to work token by token")
    for other in operands:
        if id(other) not in stream and _spans_tokens(other, shape):
            raise _refusal(
                where, f"{_describe(op)} combines the tokens with a whole tensor of shape {list(other.shape)}"
            )
    return {id(t) for t in results}


def _spans_tokens(tensor: torch.Tensor, stream: torch.Size) -> bool:
    """Whether ``tensor``, broadcast against the stream, has more than one position along the tokens."""
    from_right = len(stream) - SEQUENCE_DIM
    return tensor.dim() >= from_right and tensor.shape[-from_right] != 1


def _describe(op: Op) -> str:
    name = getattr(op.func, "__name__", str(op.func))
    return f"{name} in {op.module or 'the model'}" + (f" ({op.line})" if op.line else "")


def _refusal(where: str, why: str) -> AnnotationError:
    return AnnotationError(
        f"split.sequence_parallel would run {where} on each device's share of the tokens, but {why}. EPL cannot "
        "prove that right, so it refuses: set split.sequence_parallel to False for this model."
    )
