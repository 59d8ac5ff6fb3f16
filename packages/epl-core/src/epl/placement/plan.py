"""The Plan: where every TaskGraph of every replica runs, computed without any process group.

Placement rules:

* A replica spans D devices: the sum of its TaskGraphs' ``device_count``, or,
  with ``cluster.colocate_split_and_replicate``, the common ``device_count`` of
  all TaskGraphs (an implicit TaskGraph then widens to D); with ``pipeline.stages_per_rank=v``,
  stage s shares the devices of stage ``s % (stages / v)``, so D counts the first stages / v.
* ``replicas = world_size / D``; anything else is an error naming the numbers.
* Row-major (``cluster.device_place_prefer_intra_node``, the default): replica r
  holds devices ``r*D .. r*D+D-1``, TaskGraph after TaskGraph. Column-major:
  position s of replica r is device ``s*replicas + r``.
* Context parallelism (``context.degree`` c): a replica is c *lanes*, each laid out as
  above on its own devices (``lane_width`` = D / c of them) and taking 1/c of every
  sequence's tokens. Lane l of the job is replica ``l // c``; placement counts lanes
  where it counted replicas. Without context parallelism a lane is its replica. The
  devices at one position of a replica's lanes form a context group; tensor and
  pipeline parallelism stay inside a lane.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parameter import is_lazy

from epl.placement.memory_estimate import MemoryEstimate, distinct_notes
from epl.placement.render import count, format_bytes, format_devices, table
from epl.placement.shards import ShardRow, kept_whole_note, same_positions

if TYPE_CHECKING:
    from epl.annotations.taskgraph import TaskGraph


@dataclass(frozen=True, kw_only=True)
class TaskGraphSpec:
    """What the Plan needs to know of a TaskGraph: its strategy and the size of its parameters.

    For a split TaskGraph, ``shard_parameters``/``shard_bytes`` give what each of
    its devices holds, estimated by sharding every parameter along dimension 0
    until the split rules say otherwise; ``shards`` lists it by parameter once they
    have (``epl.plan``/``epl plan``).
    """

    index: int
    name: str
    strategy: str
    device_count: int
    implicit: bool = False
    num_parameters: int = 0
    parameter_bytes: int = 0
    shard_parameters: tuple[int, ...] = ()
    shard_bytes: tuple[int, ...] = ()
    modules: tuple[str, ...] = ()
    #: Parameters of lazy modules not yet materialised (not counted above).
    lazy_parameters: int = 0
    #: Per position of a split TaskGraph, the parameters its device holds (by the split rules); empty until
    #: estimated.
    shards: tuple[tuple[ShardRow, ...], ...] = ()

    @classmethod
    def from_taskgraph(cls, taskgraph: TaskGraph) -> TaskGraphSpec:
        """Summarise a captured TaskGraph."""
        params = [p for p in taskgraph.parameters if not is_lazy(p)]
        k = taskgraph.strategy.device_count
        shard_numel = [0] * k
        shard_bytes = [0] * k
        if taskgraph.strategy.kind == "split":
            for p in params:
                for shard, numel in enumerate(_dim0_shard_numels(p, k)):
                    shard_numel[shard] += numel
                    shard_bytes[shard] += numel * p.element_size()
        return cls(
            index=taskgraph.index,
            name=taskgraph.name,
            strategy=taskgraph.strategy.kind,
            device_count=k,
            implicit=taskgraph.implicit,
            num_parameters=sum(p.numel() for p in params),
            parameter_bytes=sum(p.numel() * p.element_size() for p in params),
            shard_parameters=tuple(shard_numel) if taskgraph.strategy.kind == "split" else (),
            shard_bytes=tuple(shard_bytes) if taskgraph.strategy.kind == "split" else (),
            modules=tuple(taskgraph.modules),
            lazy_parameters=len(taskgraph.parameters) - len(params),
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TaskGraphSpec:
        """Rebuild a spec from ``dataclasses.asdict`` output."""
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
        fields["shards"] = tuple(tuple(ShardRow.from_dict(row) for row in held) for held in data.get("shards", ()))
        return cls(**fields)

    @property
    def label(self) -> str:
        """``replicate(2)`` or ``split(4)``."""
        return f"{self.strategy}({self.device_count})"

    def held_by_position(self, position: int) -> tuple[int, int]:
        """(parameters, bytes) held by the device at ``position`` of this TaskGraph."""
        if self.strategy == "split":
            return self.shard_parameters[position], self.shard_bytes[position]
        return self.num_parameters, self.parameter_bytes


@dataclass(frozen=True)
class DeviceAssignment:
    """What one device (global rank) runs."""

    device: int
    worker: int
    replica: int
    slot: int
    #: (TaskGraph index, position of this device within that TaskGraph's devices).
    taskgraphs: tuple[tuple[int, int], ...]
    num_parameters: int
    parameter_bytes: int
    #: Which share of every sequence it takes (its lane within the replica; 0 without context parallelism).
    context_index: int = 0


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Placement of every TaskGraph of every replica on ``world_size`` devices.

    Plain data: printable (``str(plan)``), serialisable (``to_dict``/``to_json``)
    and independent of any process group, so it can be computed for clusters
    far larger than this machine.
    """

    world_size: int
    gpu_per_worker: int
    devices_per_replica: int
    num_replicas: int
    num_micro_batch: int
    colocated: bool
    row_major: bool
    taskgraphs: tuple[TaskGraphSpec, ...]
    #: Per TaskGraph, its positions (slots) within a replica's devices.
    slots: tuple[tuple[int, ...], ...]
    notes: tuple[str, ...] = field(default=())
    #: One process runs every TaskGraph (no launcher): annotations checked, not applied.
    local: bool = False
    #: Estimated memory of each rank (index = rank), filled by ``epl.plan``/``epl plan``
    #: (:mod:`epl.placement.plan_memory`); empty in the Plan of a run.
    memory: tuple[MemoryEstimate, ...] = ()
    #: Sets of TaskGraphs (indices) that hold a tensor together: tied weights cut apart by a pipeline partition.
    #: Each owner keeps a copy; their gradients are summed between the owners every step.
    shared: tuple[tuple[int, ...], ...] = ()
    #: Pipeline stages each device runs (``pipeline.stages_per_rank``, Megatron's virtual pipeline size): stage
    #: s runs on the devices of stage ``s % pipeline_size``.
    stages_per_rank: int = 1
    #: Devices each sequence's tokens are spread over (``context.degree``): a replica is this many lanes, each
    #: running every TaskGraph on its own devices, on its share of every sequence.
    context_degree: int = 1

    @property
    def lane_width(self) -> int:
        """Devices of one lane: what the TaskGraphs name (a replica's devices without context parallelism)."""
        return self.devices_per_replica // self.context_degree

    @property
    def num_lanes(self) -> int:
        """Lanes in the job: replicas times ``context_degree`` (each a full copy of the TaskGraphs' layout)."""
        return self.num_replicas * self.context_degree

    @property
    def num_stages(self) -> int:
        """Pipeline stages: TaskGraphs on different devices run one after another."""
        return 1 if self.colocated or self.local else len(self.taskgraphs)

    @property
    def pipeline_size(self) -> int:
        """How many device groups the stages run on, one after another (stages / stages per rank)."""
        return self.num_stages // self.stages_per_rank if self.num_stages > 1 else 1

    @property
    def num_workers(self) -> int:
        """Nodes in the cluster."""
        return self.world_size // self.gpu_per_worker

    def batch_parts(self, taskgraph: int) -> int:
        """Into how many parts the devices running ``taskgraph`` in one replica split the replica batch.

        A ``replicate(k)`` TaskGraph splits it k ways; a split TaskGraph does not split
        it, unless it is colocated with a ``replicate`` TaskGraph on the same devices.
        """
        if self.colocated:
            widths = [tg.device_count for tg in self.taskgraphs if tg.strategy == "replicate"]
            return max(widths, default=1)
        spec = self.taskgraphs[taskgraph]
        return spec.device_count if spec.strategy == "replicate" else 1

    def device_of(self, lane: int, slot: int) -> int:
        """The device at position ``slot`` of ``lane`` (of the replica of that index without context parallelism)."""
        if self.row_major:
            return lane * self.lane_width + slot
        return slot * self.num_lanes + lane

    def locate(self, device: int) -> tuple[int, int]:
        """(lane, slot) of ``device``: its replica and position there without context parallelism."""
        if not 0 <= device < self.world_size:
            raise ValueError(f"device {device} is not in a world of {self.world_size} devices")
        if self.row_major:
            return divmod(device, self.lane_width)
        slot, lane = divmod(device, self.num_lanes)
        return lane, slot

    def lane_of(self, rank: int) -> int:
        """The lane that ``rank`` belongs to (its replica without context parallelism)."""
        return self.locate(rank)[0]

    def replica_of(self, rank: int) -> int:
        """The replica that ``rank`` belongs to."""
        return self.lane_of(rank) // self.context_degree

    def lanes_of_replica(self, replica: int) -> range:
        """The lanes that make ``replica``."""
        return range(replica * self.context_degree, (replica + 1) * self.context_degree)

    def devices(self, taskgraph: int, replica: int | None = None) -> tuple[int, ...]:
        """Devices of ``taskgraph`` in ``replica`` (every lane of it), or in every replica when None."""
        lanes = range(self.num_lanes) if replica is None else self.lanes_of_replica(replica)
        return tuple(d for lane in lanes for d in self.lane_devices(taskgraph, lane))

    def lane_devices(self, taskgraph: int, lane: int) -> tuple[int, ...]:
        """Devices of ``taskgraph`` in ``lane`` (its replica without context parallelism), in slot order."""
        return tuple(self.device_of(lane, slot) for slot in self.slots[taskgraph])

    def devices_of_lane(self, lane: int) -> tuple[int, ...]:
        """Every device of ``lane``, in slot order."""
        return tuple(self.device_of(lane, slot) for slot in range(self.lane_width))

    def devices_of_replica(self, replica: int) -> tuple[int, ...]:
        """Every device of ``replica``, lane after lane, in slot order."""
        return tuple(d for lane in self.lanes_of_replica(replica) for d in self.devices_of_lane(lane))

    def context_groups(self) -> list[tuple[int, ...]]:
        """The devices that share every sequence: one position of every lane of a replica (empty without
        context parallelism)."""
        if self.context_degree == 1:
            return []
        return [
            tuple(self.device_of(lane, slot) for lane in self.lanes_of_replica(replica))
            for replica in range(self.num_replicas)
            for slot in range(self.lane_width)
        ]

    def context_peers(self, rank: int) -> tuple[int, ...]:
        """The devices of ``rank``'s context group, in lane order (``rank`` alone without context parallelism)."""
        lane, slot = self.locate(rank)
        return tuple(self.device_of(other, slot) for other in self.lanes_of_replica(lane // self.context_degree))

    def assignment(self, device: int) -> DeviceAssignment:
        """What ``device`` runs and holds."""
        lane, slot = self.locate(device)
        replica = lane // self.context_degree
        held = tuple(
            (tg.index, self.slots[tg.index].index(slot)) for tg in self.taskgraphs if slot in self.slots[tg.index]
        )
        if self.local:
            sizes = [(tg.num_parameters, tg.parameter_bytes) for tg in self.taskgraphs]
        else:
            sizes = [self.taskgraphs[i].held_by_position(pos) for i, pos in held]
        return DeviceAssignment(
            device=device,
            worker=device // self.gpu_per_worker,
            replica=replica,
            slot=slot,
            taskgraphs=held,
            num_parameters=sum(n for n, _ in sizes),
            parameter_bytes=sum(b for _, b in sizes),
            context_index=lane % self.context_degree,
        )

    def process_groups(self) -> dict[str, list[tuple[int, ...]]]:
        """The groups of devices that communicate, by kind, in device order.

        ``tensor parallel``: the devices of each split TaskGraph in each lane (replica without context
        parallelism); ``pipeline``: in each lane, the devices at one position of every stage (activations
        between stages; stages of one width); ``data parallel``: the devices at one place of every lane
        (gradients reduced over the copies: data x context); ``tied weights``: the devices holding copies of a
        tensor several stages share, at one position of each owner in every lane (their gradients summed
        between the stages); ``context parallel``: the devices sharing every sequence (:meth:`context_groups`).
        Empty kinds are left out.
        """
        if self.local:
            return {}
        lanes = range(self.num_lanes)
        groups: dict[str, list[tuple[int, ...]]] = {
            "tensor parallel": [
                self.lane_devices(tg.index, lane)
                for tg in self.taskgraphs
                if tg.strategy == "split" and tg.device_count > 1
                for lane in lanes
            ],
            "pipeline": [],
            "data parallel": [],
            "tied weights": [
                tuple(sorted({self.device_of(lane, self.slots[o][p]) for o in owners for lane in lanes}))
                for owners in self.shared
                for p in range(min(len(self.slots[o]) for o in owners))
            ],
            "context parallel": self.context_groups(),
        }
        widths = {tg.device_count for tg in self.taskgraphs}
        if self.num_stages > 1 and len(widths) == 1:
            (width,) = widths
            groups["pipeline"] = [
                tuple(self.lane_devices(s, lane)[p] for s in range(self.pipeline_size))
                for lane in lanes
                for p in range(width)
            ]
        if self.num_lanes > 1:  # gradients are reduced over the copies: data x context
            groups["data parallel"] = [
                tuple(self.device_of(lane, slot) for lane in lanes) for slot in range(self.lane_width)
            ]
        return {kind: sorted(set(found)) for kind, found in groups.items() if found}

    def taskgraphs_on(self, rank: int) -> tuple[int, ...]:
        """Indices of the TaskGraphs that ``rank`` runs."""
        return tuple(index for index, _ in self.assignment(rank).taskgraphs)

    # -- serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain data (lists and dicts) that :meth:`from_dict` reads back."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """Rebuild a Plan from :meth:`to_dict` output."""
        fields = dict(data)
        fields["taskgraphs"] = tuple(TaskGraphSpec.from_dict(tg) for tg in data["taskgraphs"])
        fields["slots"] = tuple(tuple(s) for s in data["slots"])
        fields["notes"] = tuple(data.get("notes", ()))
        fields["memory"] = tuple(MemoryEstimate.from_dict(m) for m in data.get("memory", ()))
        fields["shared"] = tuple(tuple(owners) for owners in data.get("shared", ()))
        return cls(**fields)

    def to_json(self, indent: int | None = 2) -> str:
        """The Plan as JSON."""
        return json.dumps(self.to_dict(), indent=indent)

    def __str__(self) -> str:
        return render_plan(self)


def _dim0_shard_numels(tensor: torch.Tensor, shards: int) -> list[int]:
    if tensor.dim() == 0:
        return [1] * shards
    rows = tensor.shape[0]
    per_row = tensor.numel() // rows if rows else 0
    return [(rows // shards + (1 if i < rows % shards else 0)) * per_row for i in range(shards)]


#: The device table lists at most this many devices (all of them in small worlds).
ALL_DEVICES_UP_TO = 16


def render_plan(plan: Plan) -> str:
    """The Plan as a human-readable report."""
    lines = [
        f"EPL plan for {count(plan.world_size, 'device')} "
        f"({count(plan.num_workers, 'worker')} x {count(plan.gpu_per_worker, 'device')})",
        f"  {count(plan.num_replicas, 'replica')} x {count(plan.devices_per_replica, 'device')} per replica"
        f"{_lanes(plan)}, "
        f"{count(plan.num_stages, 'pipeline stage')}{_interleaving(plan)}, "
        f"{'row' if plan.row_major else 'column'}-major placement",
        f"  batch: {count(plan.num_micro_batch, 'micro-batch', 'micro-batches')} per replica batch; "
        f"global batch = {plan.num_replicas} x replica batch",
        "",
    ]
    rows = [["taskgraph", "name", "strategy", "parameters", "devices"]]
    for tg in plan.taskgraphs:
        rows.append(
            [str(tg.index), tg.name, tg.label, f"{tg.num_parameters:,}", format_devices(plan.devices(tg.index))]
        )
    lines += table(rows)
    lines.append("")
    shown = list(range(plan.world_size) if plan.world_size <= ALL_DEVICES_UP_TO else plan.devices_of_replica(0))
    shown = shown[:ALL_DEVICES_UP_TO]
    rows = [["device", "worker", "replica", "runs", "parameters", "parameter memory"]]
    for device in shown:
        a = plan.assignment(device)
        runs = ", ".join(
            plan.taskgraphs[i].name + (f"[shard {pos}]" if plan.taskgraphs[i].strategy == "split" else "")
            for i, pos in a.taskgraphs
        ) + (f", context share {a.context_index}" if plan.context_degree > 1 else "")
        rows.append(
            [str(device), str(a.worker), str(a.replica), runs, f"{a.num_parameters:,}", format_bytes(a.parameter_bytes)]
        )
    lines += table(rows)
    if plan.world_size > len(shown):
        more = plan.world_size - len(shown)
        same = "; every replica is laid out like replica 0" if plan.num_replicas > 1 else ""
        lines.append(f"  ... {more} more devices{same} (Plan.assignment(device) describes any of them)")
    if groups := plan.process_groups():
        lines += ["", "process groups:", *render_groups(groups)]
    for tg in plan.taskgraphs:
        if tg.shards:
            lines += ["", *render_shards(plan, tg)]
    if plan.memory:
        lines += ["", *render_memory(plan, shown)]
    if plan.notes:
        lines += ["", "notes:"] + [f"  - {note}" for note in plan.notes]
    return "\n".join(lines)


def _lanes(plan: Plan) -> str:
    """`` (2 context lanes of 2)`` under context parallelism, else nothing."""
    if plan.context_degree == 1:
        return ""
    return f" ({plan.context_degree} context lanes of {count(plan.lane_width, 'device')})"


def _interleaving(plan: Plan) -> str:
    """`` (2 per device, on 2 device groups)`` when devices run several stages, else nothing."""
    if plan.stages_per_rank == 1 or plan.num_stages == 1:
        return ""
    return f" ({plan.stages_per_rank} per device, on {count(plan.pipeline_size, 'device group')})"


#: How many groups of each kind the Plan's text lists before it counts the rest.
GROUPS_SHOWN = 4


def render_groups(groups: dict[str, list[tuple[int, ...]]]) -> list[str]:
    """One line per kind of process group: the first few groups, then how many there are."""
    lines = []
    for kind, found in groups.items():
        shown = ", ".join("[" + format_devices(group) + "]" for group in found[:GROUPS_SHOWN])
        more = f", ... ({len(found)} groups)" if len(found) > GROUPS_SHOWN else ""
        lines.append(f"  {kind}: {shown}{more}")
    return lines


def render_shards(plan: Plan, tg: TaskGraphSpec) -> list[str]:
    """What each device of replica 0 holds of split TaskGraph ``tg``: devices holding alike share a table."""
    alike = "; every replica alike" if plan.num_replicas > 1 else ""
    lines = [f"shards of {tg.name} ({tg.label}), per device of replica 0{alike}:"]
    devices = plan.lane_devices(tg.index, 0)
    for positions, rows in same_positions(tg.shards):
        held = [devices[p] for p in positions]
        lines.append(f"  device {held[0]}:" if len(held) == 1 else f"  each of devices {format_devices(held)}:")
        lines += ["  " + line for line in table([row.cells() for row in rows])] if rows else ["    nothing"]
        note = kept_whole_note(rows)
        if note:
            lines.append(f"    note: {note}")
    return lines


def render_memory(plan: Plan, devices: Sequence[int]) -> list[str]:
    """The memory estimate of ``devices``: a table, then what it assumes."""
    lines = ["memory per device (estimated; activations are not estimated):"]
    rows = [["device", "parameters", "gradients", "optimizer states", "total"]]
    for device in devices:
        m = plan.memory[device]
        states, total = m.optimizer_state_bytes, m.total_bytes
        rows.append(
            [
                str(device),
                format_bytes(m.parameter_bytes),
                format_bytes(m.gradient_bytes),
                "unknown" if states is None else format_bytes(states),
                "unknown" if total is None else format_bytes(total),
            ]
        )
    lines += table(rows)
    lines += [f"  - {note}" for note in distinct_notes(plan.memory[d] for d in devices)]
    return lines
