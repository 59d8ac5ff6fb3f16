"""epl-pipeline's hooks: the schedules, the stage transform and the pipeline runner."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from epl.plugin_api import TransformPhase, hookimpl

if TYPE_CHECKING:
    from collections.abc import Sequence

    import click
    import torch
    from torch import nn

    from epl.plugin_api import (
        Communicator,
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
    from epl_pipeline.resharding import StageShape
    from epl_pipeline.runner import StageLink


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

    return [PipelineChoices(schedule=config["pipeline.strategy"], planned=config["auto.auto_parallel"] == "plan")]


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
        context.pipeline_stages = local
        context.stage_modules = tuple(name for name, owner_stage in roots.items() if owner_stage in local)
        from epl.plugin_api import ActionKind

        schedule = _schedule(context, plan.num_stages, plan.num_micro_batch)
        weights = ActionKind.BACKWARD_WEIGHT
        context.split_backward = any(a is not None and a.kind is weights for lane in schedule for a in lane)
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

    stages, points = config["pipeline.num_stages"], config["pipeline.split_points"]
    if points is not None:
        if stages is not None and stages != len(points) + 1:
            raise ConfigError(
                f"pipeline.split_points names {len(points)} points, which make {len(points) + 1} stages, but "
                f"pipeline.num_stages is {stages}. Leave pipeline.num_stages unset (the points decide it)."
            )
        return partition_at(model, taskgraphs, points, example_inputs)
    if not config["auto.auto_parallel"]:
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
    from epl.plugin_api import NonFiniteCheck
    from epl_pipeline.runner import PipelineStepRunner
    from epl_pipeline.stages import stage_shapes

    plan, rank = context.plan, context.cluster.rank
    lane = plan.lane_of(rank)
    local = context.pipeline_stages
    state = context.state(PipelineState)
    program, schedule = state.program, state.schedule
    assert local and program is not None and schedule is not None, "KeepLocalStage (a model transform) runs first"
    _check_clipping(context)
    stages, shapes = plan.num_stages, stage_shapes(plan)
    world = context.communicator
    # Every device of a lane (a replica without context parallelism): the global gradient norm adds their
    # squares. Every device of a replica: its loss, each lane's last stage giving 1/c of it.
    lane_group = world.split([list(plan.devices_of_lane(r)) for r in range(plan.num_lanes)])
    replica_group = (
        lane_group
        if plan.context_degree == 1
        else world.split([list(plan.devices_of_replica(r)) for r in range(plan.num_replicas)])
    )
    shares = {s: shapes[s].part(plan.lane_devices(s, lane).index(rank)) for s in local}
    last, loss_share, last_stage = stages - 1, 0.0, None
    if last in local:
        loss_share = shapes[last].loss_share(plan.lane_devices(last, lane).index(rank)) / plan.context_degree
    if shapes[last].parts > 1:  # predict gathers the last stage's parts of each micro-batch
        last_stage = _group(world, [plan.lane_devices(last, r) for r in range(plan.num_lanes)])
    runner = PipelineStepRunner(
        model=context.model,
        optimizer=context.optimizer,
        loss_fn=context.loss_fn,
        program=program,
        schedule=schedule,
        links=_links(context, local, schedule, shapes),
        num_micro_batch=plan.num_micro_batch,
        replica=replica_group,
        loss_share=loss_share,
        device=context.cluster.device,
        gradient_reducer=context.gradient_reducer,
        loss_scaler=context.loss_scaler,
        forward_contexts=context.forward_contexts,
        max_grad_norm=context.config["optimizer.max_grad_norm"],
        stage_peers=lane_group,
        stage_copies=shapes[local[0]].width,
        counted_elsewhere=_counted_elsewhere(context, local),
        clip_after_reduction=bool(plan.shared) or bool(context.reduced_in_backward),  # ZeRO reduces in backward
        shares=shares,
        last_stage=last_stage,
        rows_multiple=math.lcm(*(shape.parts for shape in shapes)),
        nonfinite=NonFiniteCheck.from_context(context),
    )
    return runner


def _links(
    context: ParallelContext, local: tuple[int, ...], schedule: Schedule, shapes: Sequence[StageShape]
) -> dict[int, tuple[StageLink | None, StageLink | None]]:
    """Each of this rank's stages' way to its previous and next stage: the device at this rank's position in
    the neighbouring stage when both run micro-batches alike (split stages exchange activations shard by
    shard), else a :class:`~epl_pipeline.resharding.Boundary` to the devices holding this device's rows.

    Messages between two ranks are matched in the order they come. With several stages per rank, one pair of
    ranks carries several links in one direction (stage 0 -> 1 and 2 -> 3, and 2 -> 1's gradients): the job's
    communicator carries them all when the schedule receives them in the order it sends them (every built-in
    schedule does); otherwise each link gets a communicator of its own, made by every rank in the same order
    (each is a process group more: its threads and sockets, on every rank).
    """
    from epl_pipeline.resharding import boundary
    from epl_pipeline.runner import Link
    from epl_pipeline.schedules import one_stream_per_pair

    plan, rank, world = context.plan, context.cluster.rank, context.communicator
    lane = plan.lane_of(rank)
    between = [world] * (plan.num_stages - 1)
    per_link = plan.stages_per_rank > 1 and not one_stream_per_pair(schedule)
    if per_link:
        between = [_link_communicator(context, stage) for stage in range(plan.num_stages - 1)]
    backward = between
    if gradients_apart(context.cluster.device):
        backward = (
            [_link_communicator(context, stage) for stage in range(plan.num_stages - 1)]
            if per_link
            else [world.split([list(world.ranks)])] * (plan.num_stages - 1)
        )

    def link(stage: int, to: int) -> StageLink:
        communicator = between[min(stage, to)]
        apart = backward[min(stage, to)]
        assert apart.ranks == communicator.ranks, "member indices must mean the same ranks in both directions"
        gradients = None if apart is communicator else apart
        position = plan.lane_devices(stage, lane).index(rank)
        if shapes[stage] == shapes[to]:
            peer = communicator.ranks.index(plan.lane_devices(to, lane)[position])
            return Link(communicator, peer, gradients)
        first, second = sorted((stage, to))
        first_members, second_members = (
            [communicator.ranks.index(d) for d in plan.lane_devices(s, lane)] for s in (first, second)
        )
        members = (first_members, second_members)
        return boundary(communicator, members, (shapes[first], shapes[second]), stage == first, position, gradients)

    last = plan.num_stages - 1
    return {s: (link(s, s - 1) if s > 0 else None, link(s, s + 1) if s < last else None) for s in local}


def gradients_apart(device: torch.device) -> bool:
    """Whether the gradients going back between two stages travel on a communicator of their own.

    NCCL runs the sends and receives between two ranks on one stream, each waiting for the one before it: a
    stage that posts its next gradient receive ahead of its next activation send, while its neighbour posts
    its next activation receive ahead of its gradient send, would wait forever (torch.distributed.pipelining
    batches the two for this reason). On their own communicators each direction is one ordered stream, as
    every message is under gloo, which matches each alone: the CPU keeps one communicator.
    """
    return device.type != "cpu"


def _link_communicator(context: ParallelContext, stage: int) -> Communicator:
    """This rank's communicator for the link from ``stage`` to ``stage + 1`` (its pair, or itself alone)."""
    plan, world = context.plan, context.communicator
    pairs = [
        (plan.lane_devices(stage, r)[p], plan.lane_devices(stage + 1, r)[p])
        for r in range(plan.num_lanes)
        for p in range(len(plan.slots[stage]))
    ]
    return _group(world, pairs)


def _group(world: Communicator, groups: Sequence[Sequence[int]]) -> Communicator:
    """This rank's communicator among ``groups`` (disjoint), every other rank alone (made by every rank)."""
    grouped = {rank for group in groups for rank in group}
    return world.split([*map(list, groups), *([rank] for rank in world.ranks if rank not in grouped)])


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

    config, plan = context.config, context.plan
    if config["optimizer.max_grad_norm"] is None or context.facts(Communication).clip_after_reduction:
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


def _counted_elsewhere(context: ParallelContext, local: tuple[int, ...]) -> frozenset[int]:
    """ids of this rank's parameters whose first holding stage runs on another rank (tied weights: that rank
    counts them in the gradient norm)."""
    holders = context.tensor_holders()
    return frozenset(id(p) for p in context.model.parameters() if min(holders.get(id(p), {local[0]})) not in local)


def _schedule(context: ParallelContext, stages: int, micro_batches: int) -> Schedule:
    """The schedule named by ``pipeline.strategy``, among every plugin's, checked before use."""
    from epl.plugin_api import EplError
    from epl_pipeline.schedules import build

    try:
        return build(
            context.config["pipeline.strategy"],
            context.plugins.pipeline_schedules(),
            stages,
            micro_batches,
            stages_per_rank=context.config["pipeline.stages_per_rank"],
        )
    except ValueError as error:
        raise EplError(f"pipeline.strategy: {error}") from None
