"""epl-comm's hook implementations: communicators, initial broadcast, gradient reduction, the DP runner."""

from __future__ import annotations

from typing import TYPE_CHECKING

from epl.plugin_api import TransformPhase, hookimpl

# Imported inside the hooks: loading this plugin (e.g. for `epl launch`) must not import PyTorch.
if TYPE_CHECKING:
    from collections.abc import Sequence

    from torch import nn

    from epl.plugin_api import (
        Cluster,
        Communicator,
        Config,
        ConfigKey,
        GradientReducer,
        ModelTransform,
        ParallelContext,
        StepRunner,
    )


@hookimpl
def epl_config_keys() -> Sequence[ConfigKey]:
    """This package's keys: ``communication.*``: fusion, fp16, clipping order, reduction, backend, timeout."""
    from epl_comm.config_keys import KEYS

    return KEYS


@hookimpl
def epl_config_facts(config: Config) -> list[object]:
    """What the core and the other plugins need of this package's keys (:class:`epl.plugin_api.Communication`)."""
    from epl.plugin_api import Communication
    from epl_comm.settings import CommSettings

    settings = CommSettings.from_config(config).communication
    return [
        Communication(
            mean=settings.gradients_reduce_method == "mean",
            float16=settings.fp16,
            clip_after_reduction=settings.clip_after_allreduce,
            timeout_s=settings.timeout,
        )
    ]


@hookimpl
def epl_make_communicator(cluster: Cluster, config: Config) -> Communicator | None:
    """torch.distributed (``auto``/``torch``) or CuPy NCCL (``cupy``) over the job's processes."""
    from epl_comm.cupy_communicator import CupyCommunicator, load_nccl
    from epl_comm.settings import CommSettings
    from epl_comm.torch_communicator import TorchCommunicator

    settings = CommSettings.from_config(config).communication
    if settings.backend == "cupy":
        load_nccl()  # a clear error on a machine where it cannot work, whatever the world size
    if cluster.world_size == 1:
        return None
    if settings.backend == "cupy":
        return CupyCommunicator.join(cluster, timeout=settings.timeout)
    return TorchCommunicator.join(cluster, timeout=settings.timeout)


class BroadcastInitialWeights:
    """Model transform: every copy starts from the first copy's parameters and buffers (a tensor sharded over its
    copies, each holding a different chunk, was made to agree before it was sharded)."""

    name = "broadcast_initial_weights"
    phase = TransformPhase.SYNC_WEIGHTS

    def __call__(self, model: nn.Module, context: ParallelContext) -> nn.Module:
        """Broadcast ``model``'s tensors from the first copy of each; return it."""
        from epl.plugin_api import data_shards
        from epl_comm.groups import groups_for

        groups = groups_for(context)
        tensors = [t for t in (*model.parameters(), *model.buffers()) if data_shards(t) is None]
        context.agree_with_first_copy(tensors, lambda copies: groups.communicators(copies)[0])
        return model


@hookimpl
def epl_model_transforms(context: ParallelContext) -> list[ModelTransform] | None:
    """Broadcast the initial weights when the plan has several copies of them."""
    return None if context.plan.local else [BroadcastInitialWeights()]


@hookimpl
def epl_make_gradient_reducer(context: ParallelContext) -> GradientReducer | None:
    """Bucketed, overlapped gradient reduction over every copy of this rank's parameters."""
    from torch import nn

    from epl.plugin_api import CoreSettings
    from epl_comm.data_parallel import DataParallelReducer, ReducePolicy, ReducerSet
    from epl_comm.groups import groups_for
    from epl_comm.settings import CommSettings
    from epl_comm.step_check import StepCheck

    if context.plan.local:
        return None
    groups = groups_for(context)
    settings = CommSettings.from_config(context.config).communication
    sparse = {
        id(module.weight)
        for module in context.model.modules()
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse
    }
    # Under ZeRO some gradients are reduced inside the backward: clipping can only follow every reduction.
    clip_after = settings.clip_after_allreduce or bool(context.reduced_in_backward)
    clip_first = CoreSettings.from_config(context.config).optimizer.max_grad_norm is not None and not clip_after
    reducers = []
    trainable = [p for p in context.model.parameters() if p.requires_grad]
    mine = [p for p in context.model.parameters() if id(p) not in context.reduced_in_backward]
    for copies, params in context.copies_of_tensors(mine).items():
        if copies.divisor == 1 and len(copies.devices) == 1:
            continue
        policy = ReducePolicy(
            copies=copies.divisor,
            num_micro_batch=context.plan.num_micro_batch,
            max_splits=settings.max_splits,
            bucket_bytes=settings.bucket_size_mb * 2**20,
            mean=settings.gradients_reduce_method == "mean",
            fp16=settings.fp16,
            fp16_scale=float(settings.fp16_scale),
            clip_after_allreduce=clip_after,
            sparse_as_dense=settings.sparse_as_dense,
        )
        reducers.append(
            DataParallelReducer(
                params,
                groups.communicators(copies),
                policy,
                sparse=[p for p in params if id(p) in sparse],
                defer_until_finish=clip_first,
                step_check=StepCheck(groups.communicators(copies)[0]) if settings.check_steps else None,
                # every rank, every trainable parameter: the reduction can decide non-finite steps for the job
                carries_verdict=len(copies.devices) == context.cluster.world_size
                and len([p for p in params if p.requires_grad]) == len(trainable),
            )
        )
    if not reducers:
        return None
    return reducers[0] if len(reducers) == 1 else ReducerSet(reducers, clip_after)


@hookimpl
def epl_make_step_runner(context: ParallelContext) -> StepRunner | None:
    """The data-parallel runner for one-stage plans on several processes."""
    from epl_comm.groups import groups_for
    from epl_comm.runner import DataParallelStepRunner

    if context.plan.local or context.plan.num_stages != 1:
        return None
    groups = groups_for(context)
    return DataParallelStepRunner.from_context(
        context, shard_index=groups.shard_index, num_shards=groups.num_shards, replica=groups.replica
    )
