"""epl-memory's hooks: the techniques switched on by the manual's memory config keys."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from epl.plugin_api import TransformPhase, WrapperPhase, hookimpl
from epl_memory.settings import MemorySettings

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch
    from torch import nn

    from epl.plugin_api import Config, ConfigKey, LossScaler, ModelTransform, OptimizerWrapper, ParallelContext

_log = logging.getLogger("epl.memory")

#: AMP's numeric keys, with their default: setting one without amp.level = O1 is an error, not a no-op.
AMP_OPTIONS = {"amp.loss_scale": "dynamic", "amp.dtype": "", "amp.growth_interval": 2000}


class GradientCheckpointing:
    """Model transform: recompute the activations ``gradient_checkpoint.type`` chooses."""

    name = "gradient_checkpointing"
    phase = TransformPhase.CHECKPOINT

    def __call__(self, model: nn.Module, context: ParallelContext) -> nn.Module:
        """Checkpoint the chosen modules of ``model`` in place; return it."""
        from epl_memory.checkpointing import (
            CheckpointingState,
            GradientCheck,
            apply_plan,
            plan_auto,
            plan_collection,
        )

        settings = MemorySettings.from_config(context.config).gradient_checkpoint
        end = settings.end_taskgraph
        owner = {id(t): tg.index for tg in context.taskgraphs for t in tg.tensors}
        owner.update({key: taskgraph for key, (taskgraph, _) in context.split_tensors.items()})

        def allowed(module: nn.Module) -> bool:
            indices = [owner.get(id(t), 0) for t in [*module.parameters(), *module.buffers()]]
            return end < 0 or all(index <= end for index in indices)

        if settings.type in ("auto", "selective"):
            plan = plan_auto(model, allowed, context.pipeline.stage_modules)
        else:
            plan = plan_collection(model, allowed)
        check = GradientCheck() if settings.check_gradients else None
        apply_plan(model, plan, check, selective=settings.type == "selective")
        state = context.state(CheckpointingState)
        state.plan, state.check = plan, check
        return model


class ApplyGroups:
    """Optimizer wrapper (``optimizer.num_apply_group = k``): the update applied in k groups of parameters."""

    name = "apply_groups"
    phase = WrapperPhase.APPLY_GROUPS

    def __call__(self, optimizer: torch.optim.Optimizer, context: ParallelContext) -> torch.optim.Optimizer:
        """Make the optimizer step in groups; return ``optimizer``."""
        from epl_memory.apply_groups import apply_in_groups

        apply_in_groups(optimizer, MemorySettings.from_config(context.config).num_apply_group)
        return optimizer


class OverlapStep:
    """Optimizer wrapper (``offload.overlap_step``): the CPU's step runs during the next forward, block by block."""

    name = "overlap_step"
    phase = WrapperPhase.OFFLOAD

    def __call__(self, optimizer: torch.optim.Optimizer, context: ParallelContext) -> torch.optim.Optimizer:
        """Defer the optimizer's step to a worker (:mod:`epl_memory.overlapped_step`); return ``optimizer``."""
        from epl_memory.blocks import outermost
        from epl_memory.overlapped_step import overlap_host_step
        from epl_memory.zero import ZeroState

        units = context.state(ZeroState).sharded
        overlap_host_step(context.model, optimizer, units, outermost(units))
        return optimizer


@hookimpl
def epl_config_keys() -> Sequence[ConfigKey]:
    """This package's keys: gradient checkpointing, ZeRO, offload, AMP and apply groups."""
    from epl_memory.config_keys import KEYS

    return KEYS


@hookimpl
def epl_config_facts(config: Config) -> list[object]:
    """What the planner and the pipeline need of this package's keys (:class:`epl.plugin_api.MemoryTechniques`)."""
    from epl.plugin_api import MemoryTechniques

    settings = MemorySettings.from_config(config)
    return [
        MemoryTechniques(
            zero=settings.zero.level,
            recompute=settings.gradient_checkpoint.type,
            mixed_precision=bool(settings.amp.level),
            parameter_dtype=settings.zero.param_dtype if settings.zero.level else "",
        )
    ]


@hookimpl
def epl_optimizer_wrappers(context: ParallelContext) -> list[OptimizerWrapper] | None:
    """Apply groups, and offload's advice on the CPU's step, as configured (ZeRO and offload need no other wrapper:
    the optimizer steps the chunks it is given)."""
    from epl_memory.offload import OffloadAdvice, offloads

    settings = MemorySettings.from_config(context.config)
    wrappers: list[OptimizerWrapper] = []
    if settings.num_apply_group > 1:
        wrappers.append(ApplyGroups())
    if offloads(context):
        wrappers.append(OffloadAdvice())
        if settings.offload.overlap_step:
            wrappers.append(OverlapStep())
    return wrappers or None


@hookimpl
def epl_model_transforms(context: ParallelContext) -> list[ModelTransform] | None:
    """Checkpointing, ZeRO's partitioning, offload and AMP's autocast, as configured; errors for bad combinations.

    (The checks run here, the first memory hook ``epl.parallelize`` calls.)
    """
    from epl_memory.offload import CPU_NOTE, offloads
    from epl_memory.zero import ZeroSharding, shards_over_copies

    settings = MemorySettings.from_config(context.config)
    _check_combinations(context)
    _check_amp(context)
    transforms: list[ModelTransform] = []
    if settings.gradient_checkpoint.type:
        transforms.append(GradientCheckpointing())
    if shards_over_copies(context) or offloads(context):
        transforms.append(ZeroSharding())
    elif settings.offload.level:
        _log.warning(CPU_NOTE)
    if settings.amp.level:
        from epl_memory.amp import Autocast

        transforms.append(Autocast())
    return transforms or None


def _check_combinations(context: ParallelContext) -> None:
    """One clear error for a combination of memory keys that cannot work."""
    from epl.plugin_api import ConfigError

    config, settings = context.config, MemorySettings.from_config(context.config)
    if not settings.zero.level and not settings.offload.level:
        for key in ("zero.param_dtype", "zero.reduce_dtype"):
            if config[key]:
                raise ConfigError(
                    f"Config key {key!r} = {config[key]!r} only applies to ZeRO and offload (FSDP2's mixed precision): "
                    f"set zero.level or offload.level too, or leave {key} unset (amp.level 'O1' lowers the precision "
                    "of the operations without them)."
                )


@hookimpl
def epl_make_loss_scaler(context: ParallelContext) -> LossScaler | None:
    """AMP's loss scaler (dynamic or ``amp.loss_scale``) when ``amp.level = O1``."""
    if not MemorySettings.from_config(context.config).amp.level:
        return None
    from epl_memory.amp import make_loss_scaler

    return make_loss_scaler(context)


def _check_amp(context: ParallelContext) -> None:
    """AMP's options without amp.level would silently do nothing: an error instead."""
    from epl.plugin_api import ConfigError

    config = context.config
    if MemorySettings.from_config(config).amp.level:
        return
    for key, default in AMP_OPTIONS.items():
        if config[key] != default:
            raise ConfigError(
                f"Config key {key!r} = {config[key]!r} only applies to mixed precision: set amp.level to 'O1' "
                f"too, or leave {key} at {default!r}."
            )


if TYPE_CHECKING:
    from epl.plugin_api import MemoryEstimate, MemoryEstimateContext


@hookimpl
def epl_adjust_memory_estimate(estimate: MemoryEstimate, context: MemoryEstimateContext) -> MemoryEstimate | None:
    """``epl plan``'s estimate with ZeRO: each rank keeps its partition of what ``zero.level`` splits."""
    from epl_memory.zero_estimate import adjust_for_zero

    return adjust_for_zero(estimate, context)
