"""epl-pipeline's hooks: the schedules, the stage transform and the pipeline runner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from epl.plugin_api import CoreSettings, TransformPhase, hookimpl
from epl_pipeline.settings import PipelineSettings

if TYPE_CHECKING:
    from collections.abc import Sequence

    import click
    from torch import nn

    from epl.plugin_api import (
        Config,
        ConfigKey,
        ModelTransform,
        ParallelContext,
        Schedule,
        ScheduleGenerator,
        StepRunner,
        TaskGraph,
    )
    from epl_pipeline.program import StageProgram


@dataclass
class PipelineState:
    """epl-pipeline's state in a ParallelContext: the stage programs the runner executes, and its schedule."""

    program: StageProgram | None = None
    schedule: Schedule | None = None


@hookimpl
def epl_config_keys() -> Sequence[ConfigKey]:
    """This package's keys: the pipeline schedule, the number of stages and the automatic partition."""
    from epl_pipeline.config_keys import KEYS

    return KEYS


@hookimpl
def epl_config_facts(config: Config) -> list[object]:
    """What the planner needs of this package's keys (:class:`epl.plugin_api.PipelineChoices`)."""
    from epl.plugin_api import PipelineChoices

    settings = PipelineSettings.from_config(config)
    return [PipelineChoices(schedule=settings.strategy, planned=settings.auto_parallel == "plan")]


@hookimpl
def epl_pipeline_schedules() -> dict[str, ScheduleGenerator]:
    """``PreferForward`` (GPipe), ``PreferBackward`` (1F1B) and ``ZeroBubble`` (ZB-H1)."""
    from epl_pipeline.schedules import SCHEDULES

    return dict(SCHEDULES)


@hookimpl
def epl_cli_commands(cli: click.Group) -> None:
    """Add ``epl schedule``."""
    from epl_pipeline.command import schedule_command

    cli.add_command(schedule_command)


def _pipelined(context: ParallelContext) -> bool:
    return not context.plan.local and context.plan.num_stages > 1


class KeepLocalStage:
    """Model transform: make the stage programs (a torch.fx trace, or a recorded run of ``forward``), then keep
    only this rank's stage modules."""

    name = "keep_local_stage"
    phase = TransformPhase.KEEP_STAGE

    def __call__(self, model: nn.Module, context: ParallelContext) -> nn.Module:
        """Make the stage programs of ``model``, then swap the other stages' root modules for placeholders."""
        from epl.plugin_api import PlacementError
        from epl_pipeline.program import stage_program
        from epl_pipeline.stages import RemoteStage, check_stages, replace_module, stage_roots

        plan = context.plan
        check_stages(plan)
        local = plan.taskgraphs_on(context.cluster.rank)
        roots = stage_roots(model, context.taskgraphs)
        empty = [tg.name for tg in plan.taskgraphs if tg.index not in set(roots.values())]
        if empty:
            raise PlacementError(
                f"Pipeline stage {empty[0]!r} holds no module of the model: the tensors created in its scope are "
                "no longer the model's (a module's parameter replaced by another stage's, e.g. tied weights "
                "head.weight = embedding.weight). Keep modules that share a tensor in one stage."
            )
        owner = {id(t): tg.index for tg in context.taskgraphs for t in tg.tensors}
        program = stage_program(model, roots, plan.num_stages, owner, context.example_inputs)
        _check_same_call_order(program, context)
        from epl.plugin_api import ActionKind, PipelinePlacement

        schedule = _schedule(context, plan.num_stages, plan.num_micro_batch)
        weights = ActionKind.BACKWARD_WEIGHT
        context.pipeline = PipelinePlacement(
            stages=local,
            stage_modules=tuple(name for name, owner_stage in roots.items() if owner_stage in local),
            split_backward=any(a is not None and a.kind is weights for lane in schedule for a in lane),
        )
        state = context.state(PipelineState)
        state.program, state.schedule = program, schedule
        device = context.cluster.device
        for name, owner_stage in roots.items():
            if owner_stage not in local:
                original = model.get_submodule(name)
                replace_module(model, name, RemoteStage(name, owner_stage, type(original).__name__, device, original))
        return model


@hookimpl
def epl_partition_model(
    model: nn.Module, taskgraphs: list[TaskGraph], config: Config, example_inputs: Any
) -> list[TaskGraph] | None:
    """Cut the model into stages: at ``pipeline.split_points``, or with ``auto.auto_parallel`` into
    ``pipeline.num_stages`` balanced stages."""
    from epl.plugin_api import ConfigError
    from epl_pipeline.auto import partition, partition_at

    settings = PipelineSettings.from_config(config)
    stages, points = settings.num_stages, settings.split_points
    if points is not None:
        if stages is not None and stages != len(points) + 1:
            raise ConfigError(
                f"pipeline.split_points names {len(points)} points, which make {len(points) + 1} stages, but "
                f"pipeline.num_stages is {stages}. Leave pipeline.num_stages unset (the points decide it)."
            )
        return partition_at(model, taskgraphs, list(points), example_inputs)
    if not settings.auto_parallel:
        return None
    if stages is None:
        raise ConfigError("auto.auto_parallel needs pipeline.num_stages: how many stages to cut the model into.")
    return partition(model, taskgraphs, stages, example_inputs) if stages > 1 else None


@hookimpl
def epl_model_transforms(context: ParallelContext) -> list[ModelTransform] | None:
    """Keep only this rank's stage when the plan is a pipeline."""
    return [KeepLocalStage()] if _pipelined(context) else None


@hookimpl
def epl_make_step_runner(context: ParallelContext) -> StepRunner | None:
    """The pipeline executor, running the schedule named by ``pipeline.strategy``."""
    if not _pipelined(context):
        return None
    from epl_pipeline.runner import PipelineStepRunner

    state = context.state(PipelineState)
    program, schedule = state.program, state.schedule
    assert context.pipeline.stages and program is not None and schedule is not None, (
        "KeepLocalStage (a model transform) runs first"
    )
    _check_clipping(context)
    return PipelineStepRunner.from_context(context, program, schedule)


def _check_same_call_order(program: Any, context: ParallelContext) -> None:
    """Every rank's replayed stages call the stage modules in one order (a collective over the job).

    Each rank records its own; a forward that loops over a set of strings orders it by the strings' hashes,
    which differ between processes unless ``PYTHONHASHSEED`` is set, and the ranks would then pair one's
    outputs with another's calls: a wrong model, silently. Refused instead.
    """
    import zlib

    import torch

    from epl.plugin_api import PlacementError

    order = getattr(program, "call_order", None)
    if order is None:
        return  # a torch.fx program: one graph, the same on every rank
    calls = order()
    mine = torch.tensor([zlib.crc32("\n".join(calls).encode())], dtype=torch.int64)
    world = context.communicator
    every = torch.zeros(world.world_size, dtype=torch.int64)
    world.all_gather(every, mine).wait()
    if len(set(every.tolist())) > 1:
        differ = [rank for rank, value in zip(world.ranks, every.tolist(), strict=True) if value != every[0]]
        raise PlacementError(
            f"The model's forward calls its pipeline stage modules in an order that differs between ranks "
            f"(ranks {differ} differ from rank {world.ranks[0]}; this rank: {', '.join(calls[:6])}...). A forward "
            "that loops over a set of strings does this (transformers' Gemma 3 and OLMo 3 loop over "
            "set(config.layer_types)): Python orders such sets by string hashes, which differ between processes. "
            "Set PYTHONHASHSEED=0 in every rank's environment (epl launch does)."
        )


def _check_clipping(context: ParallelContext) -> None:
    """Clipping before the gradient reduction needs each device to hold its replica's gradient: tied weights
    with several replicas, and stages that share micro-batches out (``replicate(k)``), need it after."""
    from epl.plugin_api import Communication, ConfigError, MemoryTechniques

    plan = context.plan
    clipping = CoreSettings.from_config(context.config).optimizer.max_grad_norm is not None
    if not clipping or context.facts(Communication).clip_after_reduction:
        return
    if context.facts(MemoryTechniques).zero:  # ZeRO always clips the reduced gradient
        return
    if plan.shared and plan.num_lanes > 1:
        raise ConfigError(
            "Tied weights cut across pipeline stages (each stage holds a copy) need clipping after the gradient "
            "all-reduce: before it, no device holds its replica's gradient of them. Set "
            "communication.clip_after_allreduce=True, or keep the tied modules on one stage."
        )
    sharing = [tg for tg in plan.taskgraphs if plan.batch_parts(tg.index) > 1]
    if sharing:
        fix = "Set communication.clip_after_allreduce=True, or make the stage replicate(1)"
        raise ConfigError(
            f"Pipeline stage {sharing[0].name!r} is {sharing[0].label}: it shares each micro-batch out over its "
            f"devices, so before the gradient all-reduce none of them holds the replica's gradient to clip. {fix} "
            "(EPL adds data parallelism over the remaining devices)."
        )


def _schedule(context: ParallelContext, stages: int, micro_batches: int) -> Schedule:
    """The schedule named by ``pipeline.strategy``, among every plugin's, checked before use."""
    from epl.plugin_api import EplError
    from epl_pipeline.schedules import build

    try:
        return build(
            PipelineSettings.from_config(context.config).strategy,
            context.plugins.pipeline_schedules(),
            stages,
            micro_batches,
            stages_per_rank=CoreSettings.from_config(context.config).pipeline.stages_per_rank,
        )
    except ValueError as error:
        raise EplError(f"pipeline.strategy: {error}") from None
