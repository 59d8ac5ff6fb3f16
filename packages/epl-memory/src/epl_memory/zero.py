"""ZeRO on torch's FSDP2: every tensor with several copies is sharded evenly over them, block by block.

Each block of the model (a transformer layer, the embeddings, the head: the units of
:func:`epl_memory.blocks.find_units`, pipeline stage roots included) is handed to ``fully_shard`` over the
devices that hold copies of its tensors (one ``DeviceMesh`` per group of copies, from the communicator EPL
already has for it). Each copy then keeps an even chunk of every tensor's rows (the last copies a shorter one,
or none, when the rows do not divide), with that chunk's gradient and optimizer state:

- ``v0`` and ``v1``: the weights are gathered whole when a block's forward begins and stay whole through its
  backward (``reshard_after_forward=False``: ZeRO-2); each block's gradient is reduce-scattered as its backward
  ends. Under v0 (ZeRO-1: only the optimizer state sharded) a step of several micro-batches accumulates each
  block's gradient whole and reduce-scatters it once, in the last micro-batch (``set_requires_gradient_sync``; the
  local step runner, not a pipeline's); v1 reduce-scatters in every micro-batch and holds only chunks between them.
- ``v2``: the weights are gathered just before each block's forward and again before its backward, the next
  block's gather posted while this one computes, and dropped after use (``reshard_after_forward=True``: ZeRO-3).

It runs before materialisation (``TransformPhase.PARTITION_PARAMETERS``): a model built on ``meta`` is chunked
first, and each device then gives values only to its chunks, so that no rank ever holds the whole model; a model
built with values is made to agree over its copies (the first copy's values) before it is chunked.

The user's optimizer is built over the sharded parameters (DTensors), so each rank keeps the state of its chunks
and steps them; no update is broadcast. The gradients are averaged over the copies by the divisor EPL's
data parallelism uses. With ``N`` copies and AdamW in float32 a device holds about ``16Ψ/N`` bytes plus the
whole weights of the blocks in use.

Under ``offload.level`` every block is handed over with FSDP2's ``CPUOffloadPolicy`` (:mod:`epl_memory.offload`):
without ``zero.level`` each device keeps whole tensors (hybrid sharding of degree 1), and a tensor one device holds is
sharded over that device alone, so that it lives in host memory too.

A tensor is kept whole (and its gradient all-reduced by the data-parallel reducer, as without ZeRO) where a
chunk cannot be proven right: a tensor held by one device, a tensor tied across pipeline stages, a tensor whose
gradient split sums over its shard group in a hook (a per-head norm), a sparse embedding, and a tensor of a block
whose other tensors have other copies (the block is sharded over the copies most of its elements have).
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from epl.plugin_api import (
    Communication,
    ConfigError,
    EplError,
    TransformPhase,
    data_shards,
    gradient_summed_over_shards,
    mark_data_sharded,
    reduce_at_last_micro_batch,
)
from epl_memory.settings import MemorySettings

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from epl.plugin_api import Communicator, ParallelContext

_log = logging.getLogger(__name__)
#: Numbers the meshes ZeRO makes in this process (see :func:`_mesh`).
_MESHES = itertools.count()


@dataclass
class ZeroState:
    """ZeRO's state in a ParallelContext: the modules it sharded and the tensors it kept whole."""

    #: The modules handed to ``fully_shard``, outermost first.
    sharded: list[nn.Module] = field(default_factory=list)
    #: Names of the parameters kept whole, with the reason (for the log and the docs' tests).
    whole: dict[str, str] = field(default_factory=dict)


class ZeroSharding:
    """Model transform (``zero.level`` v0/v1/v2 on several processes): shard each block over its copies (FSDP2)."""

    name = "zero_sharding"
    phase = TransformPhase.PARTITION_PARAMETERS

    def __call__(self, model: nn.Module, context: ParallelContext) -> nn.Module:
        """Shard ``model``'s blocks in place; record what was sharded; return ``model``."""
        from epl_memory.blocks import find_units, outermost, stage_entries

        refuse_unsupported(context)
        settings = MemorySettings.from_config(context.config)
        offload = bool(settings.offload.level)
        sharding = shards_over_copies(context)
        entries = stage_entries(model, context)
        # v2, and offload without zero.level: weights on the device only while a block uses them
        drops_weights = settings.zero.level == "v2" or not sharding
        # v0/v1 keep the blocks' weights whole through the backward: the embedding and head go to the root. Not in a
        # pipeline, whose runner may call modules below the stage roots it finds (never the roots themselves).
        units = find_units(model, entries, loose=drops_weights or bool(entries))
        if entries:  # a pipeline's runner calls the stage roots, never the model itself
            units = [unit for unit in units if unit is not model]
        names = {id(param): name for name, param in model.named_parameters(remove_duplicate=False)}
        params = list(model.parameters())
        copies_of = {id(p): copies for copies, group in context.copies_of_tensors(params).items() for p in group}
        whole = _kept_whole(model, params, copies_of, context, offload=offload)
        owner = _innermost_unit(model, units)
        by_unit: dict[int, list[nn.Parameter]] = {}
        for param in params:
            if id(param) not in whole and id(owner[id(param)]) in {id(unit) for unit in units}:
                by_unit.setdefault(id(owner[id(param)]), []).append(param)
            elif id(param) not in whole:
                whole[id(param)] = "it is outside every block this rank runs"
        chosen: dict[int, Any] = {}
        for unit in units:
            own = by_unit.get(id(unit), [])
            if not own:
                continue
            sizes: dict[Any, int] = {}
            for param in own:
                sizes[copies_of[id(param)]] = sizes.get(copies_of[id(param)], 0) + param.numel()
            copies = max(sizes, key=lambda each: sizes[each])
            chosen[id(unit)] = copies
            for param in own:
                if copies_of[id(param)] != copies:
                    whole[id(param)] = "its block's other tensors have other copies"
        state = context.state(ZeroState)
        state.whole = {names.get(key, "?"): why for key, why in whole.items()}
        for name, why in state.whole.items():
            _log.info("zero.level: %s stays whole on every copy: %s", name, why)
        ignored = {p for p in params if id(p) in whole}
        before = {
            (id(module), name): param
            for module in model.modules()
            for name, param in module._parameters.items()
            if param is not None
        }
        communicators = context.copy_communicators()
        _agree_before_sharding([p for p in params if id(p) not in whole], context)
        # offload without zero.level: every copy keeps whole tensors (shards of one device), replicated over copies
        hybrid = HybridGroups.of(context, degree=None if sharding else 1)
        meshes: dict[Any, Any] = {}
        # not under a zero-bubble schedule, whose stages keep the weights through a step (epl_memory.step_end_reduction)
        split_backward = context.pipeline.split_backward
        reshard = drops_weights and not split_backward
        precision = mixed_precision(context)
        home = torch.device("cpu") if offload else None
        policy = offload_policy(context)
        # v0 shards only the optimizer state: gradients accumulate whole over micro-batches, reduced in the last
        # (not under offload, whose gradients must leave the device)
        accumulate_whole = sharding and settings.zero.level == "v0" and not offload and not split_backward
        sum_mean = context.facts(Communication).mean
        sharded: list[nn.Module] = []
        # The modules the runner calls (the model, or a pipeline's stage roots) are sharded even when they hold no
        # tensor of their own: FSDP2 makes the outermost sharded module the root, whose state the blocks below it
        # share. Without it every block is a root of its own, and each keeps its reduce-scatter input (its whole
        # gradients) until the end of backward, where a shared root frees it when the next block's backward begins.
        roots = {id(called) for called in entries} if entries else {id(model)}
        for unit in reversed(units):  # innermost first, as fully_shard wants
            copies = chosen.get(id(unit))
            if copies is None and id(unit) in roots:
                inner = [chosen[id(module)] for module in unit.modules() if id(module) in chosen]
                copies = max(inner, key=inner.count) if inner else None
            if copies is None:
                continue
            if copies not in meshes:
                meshes[copies] = (
                    one_process_mesh(context.cluster.device)
                    if context.plan.local
                    else hybrid.mesh(copies.devices, communicators, context.cluster.device)
                )
            # fully_shard takes every parameter below the unit that no inner unit took: leave it those of the units
            # above (a tied weight belongs to the unit above both its users) and the whole ones
            inside = {id(inner) for inner in unit.modules()}
            theirs = {p for p in params if id(p) not in whole and id(owner[id(p)]) not in inside}
            _shard(unit, meshes[copies], reshard=reshard, ignored=ignored | theirs, precision=precision, offload=policy)
            divisor = float(copies.divisor) if sum_mean else 1.0
            # FSDP2 divides by its mesh's size unless told otherwise; told, it divides twice where the shards are of
            # one device (hybrid sharding of degree 1) in float64, so it is told only where the divisor differs
            if divisor != meshes[copies].size():
                unit.set_gradient_divide_factor(divisor)  # type: ignore[operator]  # an FSDPModule now
            if accumulate_whole:
                reduce_at_last_micro_batch(unit)
            sharded.append(unit)
        _follow_new_parameters(model, before, copies_of, hybrid.chunk_communicators(communicators), context, home)
        if reshard and context.cluster.device.type != "cpu":  # a CPU has no streams to overlap on
            _prefetch(model, sharded)
        if split_backward:
            from epl_memory.step_end_reduction import reduce_at_step_end

            reduce_at_step_end(outermost(sharded))
        elif policy is not None:  # (a zero-bubble stage's gradients reach the host once a step: nothing to sum)
            _sum_host_gradients(model, sharded, context.cluster.device)
        for called in (*entries, model):
            called.forward = _explain_chunked_reads(called.forward)
        state.sharded = sharded[::-1]
        return model


def shards_over_copies(context: ParallelContext) -> bool:
    """Whether ``zero.level`` shards this job's tensors (set, several processes: one process has nothing to share)."""
    return bool(MemorySettings.from_config(context.config).zero.level) and not context.plan.local


def refuse_unsupported(context: ParallelContext) -> None:
    """One clear error for what ZeRO and offload on FSDP2 cannot do (yet)."""
    settings = MemorySettings.from_config(context.config)
    if shards_over_copies(context):
        key, value = "zero.level", settings.zero.level
    else:
        key, value = "offload.level", settings.offload.level
    setting = f"{key} {value!r}"
    if not context.plan.local and context.communicator.process_group() is None:
        raise ConfigError(
            f"{setting} shards tensors with torch's FSDP2, which needs a torch.distributed process group; the "
            f"communication backend {type(context.communicator).__name__} has none. Use the default torch backend, "
            f"or leave {key} unset."
        )


def _agree_before_sharding(params: Sequence[nn.Parameter], context: ParallelContext) -> None:
    """Copy the first copy's values of ``params`` into every copy, as the weights' synchronisation does for the
    tensors kept whole (it comes later, and skips chunks). A model built on ``meta`` has no values yet: each device
    gets its chunks' values from the job's seed when the model is materialised, the same on every copy."""
    context.agree_with_first_copy([param for param in params if not param.is_meta])


def _kept_whole(
    model: nn.Module,
    params: Sequence[nn.Parameter],
    copies_of: dict[int, Any],
    context: ParallelContext,
    *,
    offload: bool,
) -> dict[int, str]:
    """Parameter id -> why ZeRO keeps it whole on every copy (see the module doc); under offload a tensor one device
    holds is sharded over that device alone (so that it lives in host memory)."""
    shared = context.plan.shared
    holders = context.tensor_holders()
    sparse = {
        id(module.weight)
        for module in model.modules()
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse
    }
    whole: dict[int, str] = {}
    for param in params:
        key = id(param)
        if len(copies_of[key].devices) < 2 and not offload:
            whole[key] = "no other device holds a copy of it"
        elif tuple(sorted(holders.get(key, ()))) in shared:
            whole[key] = "it is tied across pipeline stages"
        elif gradient_summed_over_shards(param):
            whole[key] = "split sums its gradient over the shards in a hook"
        elif key in sparse:
            whole[key] = "its gradient is sparse"
    return whole


def _innermost_unit(model: nn.Module, units: Sequence[nn.Module]) -> dict[int, nn.Module]:
    """Parameter id -> the innermost of ``units`` holding it (the one whose ``fully_shard`` manages it); a parameter
    several units hold goes to the innermost one above all of them, ``model`` for one above every unit."""
    unit_ids = {id(unit) for unit in units}
    owner: dict[int, nn.Module] = {}

    def visit(module: nn.Module, current: nn.Module) -> None:
        here = module if id(module) in unit_ids else current
        for param in module.parameters(recurse=False):
            owner.setdefault(id(param), here)
            if owner[id(param)] is not here:  # held by two units: their common ancestor unit
                owner[id(param)] = _common(model, owner[id(param)], here, unit_ids)
        for child in module.children():
            visit(child, here)

    visit(model, model)
    return owner


def _common(model: nn.Module, first: nn.Module, second: nn.Module, unit_ids: set[int]) -> nn.Module:
    """The innermost unit (or ``model``) above both ``first`` and ``second``."""
    above: dict[int, list[nn.Module]] = {}

    def paths(module: nn.Module, trail: list[nn.Module]) -> None:
        trail = [*trail, module] if id(module) in unit_ids or module is model else trail
        above.setdefault(id(module), trail)
        for child in module.children():
            paths(child, trail)

    paths(model, [])
    first_path, second_path = above[id(first)], above[id(second)]
    common = model
    for a, b in zip(first_path, second_path, strict=False):
        if a is not b:
            break
        common = a
    return common


@dataclass
class HybridGroups:
    """``zero.shard_degree`` k: each group of copies cut into shard groups of k consecutive devices, and replicate
    groups of the devices at the same place in each (communicators made on every rank alike); k = 0: none."""

    degree: int = 0
    #: Communicators of this rank by device group: its shard group's and its replicate group's.
    communicators: dict[tuple[int, ...], Communicator] = field(default_factory=dict)

    @classmethod
    def of(cls, context: ParallelContext, degree: int | None = None) -> HybridGroups:
        """The hybrid groups of ``context``'s plan (a collective: every rank makes every group), of ``degree`` or
        ``zero.shard_degree``."""
        from epl.plugin_api import communicators_for, every_copy_group

        if context.plan.local:
            return cls()
        degree = MemorySettings.from_config(context.config).zero.shard_degree if degree is None else degree
        groups = [group for group in every_copy_group(context.plan) if len(group) > 1]
        if degree == 0 or all(len(group) <= degree for group in groups):
            return cls()
        cut = []
        for group in groups:
            if len(group) % degree:
                raise ConfigError(
                    f"zero.shard_degree {degree} does not divide the {len(group)} copies of some tensors (devices "
                    f"{list(group)}): use a divisor of every data-parallel degree, or 0 to shard over all copies."
                )
            shards = [group[start : start + degree] for start in range(0, len(group), degree)]
            cut += shards + [tuple(shard[i] for shard in shards) for i in range(degree)]
        return cls(degree, communicators_for(context.communicator, cut))

    def parts(self, devices: tuple[int, ...], rank: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """This rank's replicate and shard groups within ``devices`` (None: shard over all of them)."""
        if not self.degree or len(devices) <= self.degree:
            return None
        shards = [devices[start : start + self.degree] for start in range(0, len(devices), self.degree)]
        mine = next(shard for shard in shards if rank in shard)
        position = mine.index(rank)
        return tuple(shard[position] for shard in shards), mine

    def mesh(self, devices: tuple[int, ...], communicators: dict[Any, Communicator], device: torch.device) -> Any:
        """The ``DeviceMesh`` to shard a tensor held by ``devices``: one dimension over them all, or replicate x
        shard under hybrid sharding.

        Named uniquely: DTensor caches how its operations shard by the meshes involved, and two meshes over the same
        ranks with the same names compare equal, so a mesh of an earlier ``epl.init`` (whose groups are gone) would
        come back from that cache.
        """
        from torch.distributed.device_mesh import DeviceMesh

        serial = next(_MESHES)
        rank = communicators[devices].ranks[communicators[devices].rank]
        parts = self.parts(devices, rank)
        if parts is None:
            return DeviceMesh.from_group(
                _group_of(communicators[devices]), device.type, mesh_dim_names=(f"copies{serial}",)
            )
        replicate, shard = parts
        layout = torch.tensor(devices, dtype=torch.int).view(len(devices) // self.degree, self.degree)
        return DeviceMesh.from_group(
            [_group_of(self.communicators[replicate]), _group_of(self.communicators[shard])],
            device.type,
            mesh=layout,
            mesh_dim_names=(f"replicate{serial}", f"shard{serial}"),
        )

    def chunk_communicators(self, communicators: dict[Any, Communicator]) -> dict[Any, Communicator]:
        """By device group of copies: the communicator over the devices whose chunks together make a tensor (the
        shard group under hybrid sharding: the replicate groups hold the same chunks)."""
        chunked = dict(communicators)
        for devices, communicator in communicators.items():
            parts = self.parts(devices, communicator.ranks[communicator.rank])
            if parts is not None:
                chunked[devices] = self.communicators[parts[1]]
        return chunked


def _shard(
    unit: nn.Module, mesh: Any, *, reshard: bool, ignored: set[nn.Parameter], precision: Any, offload: Any
) -> None:
    """``fully_shard`` one block (its tensors not yet managed by an inner block, but for ``ignored``)."""
    from torch.distributed.fsdp import OffloadPolicy, fully_shard

    fully_shard(
        unit,
        mesh=mesh,
        reshard_after_forward=reshard,
        ignored_params=ignored,
        mp_policy=precision,
        offload_policy=offload if offload is not None else OffloadPolicy(),
    )


def offload_policy(context: ParallelContext) -> Any:
    """FSDP2's ``CPUOffloadPolicy`` under ``offload.level`` (pinned host memory on CUDA), else None."""
    if not MemorySettings.from_config(context.config).offload.level:
        return None
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=context.cluster.device.type == "cuda")


def _group_of(communicator: Communicator) -> ProcessGroup:
    """``communicator``'s torch process group (:func:`refuse_unsupported` refused a backend without one)."""
    return cast("ProcessGroup", communicator.process_group())


def one_process_mesh(device: torch.device) -> Any:
    """A ``DeviceMesh`` over this process alone, for a job of one process (offload on one GPU).

    FSDP2 needs a process group; a job of one process has none, so this makes the default group over an in-process
    ``HashStore`` (nothing listens) unless the script made one.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if not dist.is_initialized():
        backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() != 1:
        raise EplError(
            f"epl.init found one process, but the default process group has {dist.get_world_size()}: launch every "
            "process through epl launch or torchrun so that EPL sees them."
        )
    world = cast("ProcessGroup", dist.group.WORLD)  # made above, if it was not
    return DeviceMesh.from_group(world, device.type, mesh_dim_names=(f"alone{next(_MESHES)}",))


#: The dtypes ``zero.param_dtype`` and ``zero.reduce_dtype`` name.
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def mixed_precision(context: ParallelContext) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` from ``zero.param_dtype`` and ``zero.reduce_dtype`` (and
    ``communication.fp16``: gradients reduced in float16, as EPL's data parallelism sends them)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    settings = MemorySettings.from_config(context.config).zero
    param = DTYPES.get(settings.param_dtype)
    reduce = DTYPES.get(settings.reduce_dtype)
    if reduce is None and param is None and context.facts(Communication).float16:
        reduce = torch.float16
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)


def _follow_new_parameters(
    model: nn.Module,
    before: dict[tuple[int, str], nn.Parameter],
    copies_of: dict[int, Any],
    communicators: dict[Any, Communicator],
    context: ParallelContext,
    home: torch.device | None,
) -> None:
    """``fully_shard`` replaced each sharded parameter by a new one (a DTensor): carry EPL's marks and bookkeeping
    over to it, so that split's shard spec, the TaskGraphs' tensors and the copies they have find it, and the old
    whole tensor is freed."""
    from epl.plugin_api import set_shard_spec, shard_spec

    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            old = before.get((id(module), name))
            if old is None or param is None or param is old:
                continue
            replaced[id(old)] = param
            set_shard_spec(param, shard_spec(old))
            copies = copies_of[id(old)]
            mark_data_sharded(param, communicators[copies.devices], home)
            context.reduced_in_backward.add(id(param))
    for taskgraph in context.taskgraphs:
        taskgraph.tensors = [replaced.get(id(tensor), tensor) for tensor in taskgraph.tensors]
    tables: tuple[dict[int, Any], ...] = (context.split_tensors, context.split_holders)
    for table in tables:
        for key in [key for key in table if key in replaced]:
            table[id(replaced[key])] = table.pop(key)


def _explain_chunked_reads(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward``, with a clear error where it computes with another block's parameter (a chunk there)."""

    @functools.wraps(forward)
    def checked(*args: Any, **kwargs: Any) -> Any:
        try:
            return forward(*args, **kwargs)
        except RuntimeError as exc:
            if "got mixed torch.Tensor and DTensor" not in str(exc):
                raise
            raise EplError(
                "The model reads another block's parameter directly: under zero.level each block's parameters are "
                "whole only while that block runs (between its uses each device holds a chunk of them), so a forward "
                "that reads a parameter outside the block that holds it (module.weight used in another module's "
                "forward) finds a chunk. Call the module that holds the parameter instead, or leave zero.level "
                f"unset. (PyTorch said: {str(exc).splitlines()[0]})"
            ) from exc

    return checked


def _sum_host_gradients(model: nn.Module, sharded: Sequence[nn.Module], device: torch.device) -> None:
    """Offload: sum the gradients of a step's micro-batches outside the backward (:mod:`epl_memory.host_gradients`)."""
    from epl_memory.host_gradients import HostGradientSums

    chunked = [p for p in model.parameters() if data_shards(p) is not None]  # marked by _follow_new_parameters
    HostGradientSums(chunked, device).install(model, sharded)


def _prefetch(model: nn.Module, sharded: Sequence[nn.Module]) -> None:
    """v2: each item of a list of blocks (transformer layers) posts the next item's gather in its forward and the
    previous item's in its backward; FSDP2 orders the rest itself."""
    from torch.distributed.fsdp import FSDPModule

    ids = {id(block) for block in sharded}
    for container in model.modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        blocks = [item for item in container if id(item) in ids and isinstance(item, FSDPModule)]
        for current, following in zip(blocks, blocks[1:], strict=False):
            current.set_modules_to_forward_prefetch([following])
            following.set_modules_to_backward_prefetch([current])
