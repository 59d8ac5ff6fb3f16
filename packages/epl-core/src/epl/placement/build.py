"""The placement rules: TaskGraphs -> a Plan for a world size (``build_plan``) or one process (``build_local_plan``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from epl.config.settings import CoreSettings
from epl.errors import PlacementError
from epl.placement.plan import Plan, TaskGraphSpec

if TYPE_CHECKING:
    from epl.config import Config


def build_plan(
    taskgraphs: Sequence[TaskGraphSpec],
    *,
    world_size: int,
    gpu_per_worker: int | None,
    config: Config,
) -> Plan:
    """Place ``taskgraphs`` on ``world_size`` devices following the placement rules."""
    gpu_per_worker = gpu_per_worker or world_size
    if world_size < 1 or world_size % gpu_per_worker:
        raise PlacementError(f"World size {world_size} is not a multiple of {gpu_per_worker} devices per worker.")
    settings = CoreSettings.from_config(config)
    colocated = settings.cluster.colocate_split_and_replicate
    row_major = settings.cluster.device_place_prefer_intra_node
    per_rank = settings.pipeline.stages_per_rank
    context = settings.context.degree
    specs, lane_width, slots = _replica_layout(taskgraphs, colocated, per_rank)
    width = lane_width * context
    if world_size % width:
        parts = " + ".join(f"{tg.name}: {tg.device_count}" for tg in specs)
        how = "the common device_count (colocated)" if colocated else parts
        lanes = f", times context.degree {context}" if context > 1 else ""
        raise PlacementError(
            f"The model needs {width} devices per replica ({how}{lanes}), but the world size {world_size} "
            f"is not a multiple of {width}. Run on a multiple of {width} devices "
            f"({', '.join(str(width * i) for i in range(1, 4))}, ...) or change the annotations' device_count."
        )
    replicas = world_size // width
    return Plan(
        world_size=world_size,
        gpu_per_worker=gpu_per_worker,
        devices_per_replica=width,
        num_replicas=replicas,
        num_micro_batch=settings.pipeline.num_micro_batch,
        colocated=colocated,
        row_major=row_major,
        taskgraphs=tuple(specs),
        slots=tuple(slots),
        notes=tuple(_notes(specs, width, replicas * context, gpu_per_worker, colocated, row_major))
        + ((_context_note(lane_width, context),) if context > 1 else ()),
        stages_per_rank=per_rank,
        context_degree=context,
    )


def _context_note(lane_width: int, context: int) -> str:
    """What context parallelism does to the replicas, for the Plan's notes."""
    lane = "one device" if lane_width == 1 else f"{lane_width} devices"
    return (
        f"Context parallelism (context.degree {context}): each replica is {context} lanes of {lane}, each "
        f"running the whole layout on 1/{context} of every sequence's tokens; the devices at one position of a "
        "replica's lanes attend together (context parallel groups). Every rank of a replica is given the "
        "replica's whole batch."
    )


def build_local_plan(taskgraphs: Sequence[TaskGraphSpec], *, config: Config) -> Plan:
    """The Plan of a run in one process: every TaskGraph on device 0, one replica.

    The annotations are still checked: the placement they ask for must be valid
    on one replica's worth of devices.
    """
    settings = CoreSettings.from_config(config)
    colocated = settings.cluster.colocate_split_and_replicate
    per_rank = settings.pipeline.stages_per_rank
    specs, width, _ = _replica_layout(taskgraphs, colocated, per_rank)
    note = (
        f"One process runs every TaskGraph locally; launched on a multiple of {width} devices "
        f"this model would run as {width} device{'s' if width != 1 else ''} per replica."
    )
    return Plan(
        world_size=1,
        gpu_per_worker=1,
        devices_per_replica=1,
        num_replicas=1,
        num_micro_batch=settings.pipeline.num_micro_batch,
        colocated=colocated,
        row_major=True,
        taskgraphs=tuple(specs),
        slots=((0,),) * len(specs),
        notes=(note, *_notes(specs, 1, 1, 1, colocated, True)),
        local=True,
        stages_per_rank=per_rank,
    )


def _replica_layout(
    taskgraphs: Sequence[TaskGraphSpec], colocated: bool, stages_per_rank: int = 1
) -> tuple[list[TaskGraphSpec], int, list[tuple[int, ...]]]:
    """(TaskGraphs, devices per replica, each TaskGraph's slots in a replica)."""
    specs = list(taskgraphs)
    if stages_per_rank > 1:
        return _interleaved_layout(specs, colocated, stages_per_rank)
    if colocated:
        width = max((tg.device_count for tg in specs if not tg.implicit), default=1)
        if any(not tg.implicit and tg.device_count != width for tg in specs):
            counts = ", ".join(f"{tg.name}: {tg.device_count}" for tg in specs if not tg.implicit)
            raise PlacementError(
                "With cluster.colocate_split_and_replicate=True all TaskGraphs share the same devices, "
                f"so their device_count must be equal; got {counts}. Use one device_count for every "
                "annotation, or set cluster.colocate_split_and_replicate to False."
            )
        specs = [replace(tg, device_count=width) if tg.implicit else tg for tg in specs]
        return specs, width, [tuple(range(width))] * len(specs)
    offsets = [sum(tg.device_count for tg in specs[:i]) for i in range(len(specs))]
    slots = [tuple(range(o, o + tg.device_count)) for o, tg in zip(offsets, specs, strict=True)]
    return specs, sum(tg.device_count for tg in specs), slots


def _interleaved_layout(
    specs: list[TaskGraphSpec], colocated: bool, per_rank: int
) -> tuple[list[TaskGraphSpec], int, list[tuple[int, ...]]]:
    """Stage s on the devices of stage ``s % P`` (P = stages / ``per_rank``), each device group running
    ``per_rank`` stages (Megatron's virtual pipeline)."""
    stages = len(specs)
    if colocated:
        raise PlacementError(
            "pipeline.stages_per_rank > 1 places several pipeline stages on each device group, but "
            "cluster.colocate_split_and_replicate=True runs every TaskGraph on the same devices as one stage. "
            "Set one of them back to its default."
        )
    if stages % per_rank or stages // per_rank < 2:
        raise PlacementError(
            f"pipeline.stages_per_rank={per_rank} runs {per_rank} pipeline stages on each device group, so the "
            f"number of stages must be a multiple of {per_rank} with at least 2 groups; the model has "
            f"{stages} stage(s) ({', '.join(tg.name for tg in specs)}). Cut the model into "
            f"{2 * per_rank}, {3 * per_rank}, ... stages or change pipeline.stages_per_rank."
        )
    groups = stages // per_rank
    for tg in specs[groups:]:
        first = specs[tg.index % groups]
        if tg.device_count != first.device_count:
            raise PlacementError(
                f"{tg.name} ({tg.label}) runs on the devices of {first.name} ({first.label}) with "
                f"pipeline.stages_per_rank={per_rank}, so both need the same device_count."
            )
    offsets = [sum(tg.device_count for tg in specs[:i]) for i in range(groups)]
    slots = [tuple(range(offsets[i % groups], offsets[i % groups] + tg.device_count)) for i, tg in enumerate(specs)]
    return specs, sum(tg.device_count for tg in specs[:groups]), slots


def _notes(
    specs: Sequence[TaskGraphSpec],
    width: int,
    replicas: int,
    gpu_per_worker: int,
    colocated: bool,
    row_major: bool,
) -> list[str]:
    notes = []
    for tg in specs:
        if not tg.implicit and tg.num_parameters == 0:
            notes.append(f"{tg.name} ({tg.label}) holds no parameters of the model.")
        if tg.implicit:
            notes.append(f"{tg.name} holds modules created outside any annotation; it is replicate({tg.device_count}).")
        if tg.lazy_parameters:
            notes.append(
                f"{tg.name} has {tg.lazy_parameters} uninitialised (lazy) parameters, not counted: run one "
                "forward pass before epl.parallelize to materialise them."
            )
        if tg.strategy == "replicate" and tg.device_count > 1:
            notes.append(f"{tg.name} splits each replica batch {tg.device_count} ways.")
    if not row_major and replicas > 1:
        notes.append(
            "Column-major placement (cluster.device_place_prefer_intra_node=False): "
            "a replica's devices are spread over nodes."
        )
    elif width > gpu_per_worker:
        notes.append(
            f"A replica needs {width} devices, more than the {gpu_per_worker} of one worker: replicas span nodes."
        )
    elif gpu_per_worker % width:
        notes.append(
            f"{width} devices per replica do not divide {gpu_per_worker} devices per worker: "
            "some replicas span two nodes."
        )
    if colocated and len(specs) > 1:
        notes.append("TaskGraphs are colocated (cluster.colocate_split_and_replicate=True): one stage, no pipeline.")
    return notes
