"""The Plan: placement rules for several world sizes, errors that name the numbers, serialisation."""

from __future__ import annotations

from dataclasses import asdict, replace

import pytest
import torch
from torch import nn

import epl
from epl.examples import manual as examples
from epl.placement import Plan, TaskGraphSpec, build_plan


def spec(
    index: int, strategy: str, count: int, *, params: int = 100, implicit: bool = False, name: str | None = None
) -> TaskGraphSpec:
    shards = tuple(params // count for _ in range(count)) if strategy == "split" else ()
    return TaskGraphSpec(
        index=index,
        name=name or f"tg{index}",
        strategy=strategy,
        device_count=count,
        implicit=implicit,
        num_parameters=params,
        parameter_bytes=4 * params,
        shard_parameters=shards,
        shard_bytes=tuple(4 * s for s in shards),
    )


def place(specs: list[TaskGraphSpec], world: int, per_worker: int | None = None, **config: object) -> Plan:
    return build_plan(specs, world_size=world, gpu_per_worker=per_worker, config=epl.Config(config))


def test_two_stages_on_four_devices_is_row_major() -> None:
    plan = place([spec(0, "replicate", 1), spec(1, "replicate", 1)], 4)
    assert (plan.num_replicas, plan.devices_per_replica, plan.num_stages) == (2, 2, 2)
    assert plan.devices(0) == (0, 2) and plan.devices(1) == (1, 3)
    assert [plan.replica_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert plan.taskgraphs_on(3) == (1,)


def test_column_major_when_intra_node_is_not_preferred() -> None:
    plan = place(
        [spec(0, "replicate", 1), spec(1, "replicate", 1)], 4, **{"cluster.device_place_prefer_intra_node": False}
    )
    assert plan.devices(0) == (0, 1) and plan.devices(1) == (2, 3)
    assert [plan.replica_of(r) for r in range(4)] == [0, 1, 0, 1]
    assert any("Column-major" in note for note in plan.notes)


@pytest.mark.parametrize(
    ("counts", "world", "replicas", "first_replica"),
    [
        ([1], 8, 8, [[0]]),
        ([1, 1], 8, 4, [[0], [1]]),
        ([2, 1], 6, 2, [[0, 1], [2]]),
        ([1, 1, 1, 1], 8, 2, [[0], [1], [2], [3]]),
        ([1, 1], 1024, 512, [[0], [1]]),
        ([4], 1024, 256, [[0, 1, 2, 3]]),
    ],
)
def test_placement_table(counts: list[int], world: int, replicas: int, first_replica: list[list[int]]) -> None:
    plan = place([spec(i, "replicate", c) for i, c in enumerate(counts)], world)
    assert plan.num_replicas == replicas
    assert [list(plan.devices(i, replica=0)) for i in range(len(counts))] == first_replica
    width = sum(counts)
    last = replicas - 1
    assert plan.devices(0, replica=last)[0] == last * width
    # every device runs exactly one TaskGraph and the table covers the world once
    assert sorted(d for i in range(len(counts)) for d in plan.devices(i)) == list(range(world))


def test_colocated_taskgraphs_share_devices() -> None:
    plan = place(
        [spec(0, "replicate", 8), spec(1, "split", 8, params=800)],
        16,
        8,
        **{"cluster.colocate_split_and_replicate": True},
    )
    assert (plan.num_replicas, plan.devices_per_replica, plan.num_stages) == (2, 8, 1)
    assert plan.devices(0, 1) == plan.devices(1, 1) == tuple(range(8, 16))
    a = plan.assignment(9)
    assert a.taskgraphs == ((0, 1), (1, 1)) and a.num_parameters == 100 + 100 and a.worker == 1


def test_colocated_implicit_taskgraph_widens() -> None:
    plan = place(
        [spec(0, "replicate", 1, implicit=True), spec(1, "split", 4)],
        8,
        **{"cluster.colocate_split_and_replicate": True},
    )
    assert plan.taskgraphs[0].device_count == 4 and plan.devices(0, 0) == (0, 1, 2, 3)


def test_colocated_unequal_counts_is_an_error() -> None:
    with pytest.raises(epl.PlacementError, match=r"device_count must be equal; got a: 4, b: 8"):
        place(
            [spec(0, "replicate", 4, name="a"), spec(1, "split", 8, name="b")],
            8,
            **{"cluster.colocate_split_and_replicate": True},
        )


def test_sizes_that_do_not_divide_name_the_numbers() -> None:
    with pytest.raises(
        epl.PlacementError,
        match=r"needs 3 devices per replica \(stage_0: 1 \+ stage_1: 2\), but the world size 8 is not a multiple of 3"
        r".*\(3, 6, 9, \.\.\.\)",
    ):
        place([spec(0, "replicate", 1, name="stage_0"), spec(1, "replicate", 2, name="stage_1")], 8)
    with pytest.raises(epl.PlacementError, match="world size 2 is not a multiple of 4"):
        place([spec(0, "split", 4)], 2)
    with pytest.raises(epl.PlacementError, match="World size 6 is not a multiple of 4 devices per worker"):
        place([spec(0, "replicate", 1)], 6, 4)


def test_split_parameters_per_device_and_memory() -> None:
    epl.init()
    with epl.split(4, name="head"):
        model = nn.Linear(8, 10)  # 10 rows of 9 (weight + bias): shards of 3, 3, 2, 2 rows
    plan = epl.plan(model, world_size=8)
    assert [plan.assignment(d).num_parameters for d in range(4)] == [27, 27, 18, 18]
    assert plan.assignment(0).parameter_bytes == 27 * 4
    assert plan.num_replicas == 2


def test_notes_for_nodes_and_empty_taskgraphs() -> None:
    plan = place([spec(0, "replicate", 3, params=0, name="empty")], 12, 4)
    text = "\n".join(plan.notes)
    assert "empty (replicate(3)) holds no parameters" in text
    assert "3 devices per replica do not divide 4 devices per worker" in text
    assert "splits each replica batch 3 ways" in text
    wide = place([spec(0, "replicate", 8)], 16, 4)
    assert any("replicas span nodes" in note for note in wide.notes)


def test_plan_round_trips_through_json() -> None:
    plan = place([spec(0, "replicate", 2), spec(1, "split", 2, params=10)], 8, 4, **{"pipeline.num_micro_batch": 4})
    again = Plan.from_dict(__import__("json").loads(plan.to_json()))
    assert again == plan
    assert str(again) == str(plan)


def test_split_plan_round_trips_through_json_with_its_shards() -> None:
    epl.init()
    with epl.split(4, name="head"):
        model = nn.Linear(8, 10)
    plan = epl.plan(model, world_size=8)
    weight, bias = plan.taskgraphs[0].shards[2]
    assert (weight.name, weight.module, weight.shape, weight.whole, weight.sharded) == (
        "weight",
        "Linear",
        (2, 8),
        (10, 8),
        True,
    )
    assert (bias.shape, bias.whole) == ((2,), (10,))
    again = Plan.from_dict(__import__("json").loads(plan.to_json()))
    assert again == plan and str(again) == str(plan)
    assert "  each of devices 0, 1:\n" in str(plan) and "  each of devices 2, 3:\n" in str(plan)


def test_tied_weights_show_once_with_their_other_name() -> None:
    epl.init()
    with epl.split(2, name="lm"):
        model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    plan = epl.plan(model, world_size=2)
    assert "    1.weight (tied to 0.weight)  [5, 4]  of [10, 4]\n" in str(plan)
    assert [m.parameter_bytes for m in plan.memory] == [4 * 20, 4 * 20]


class _Projection(nn.Module):
    """Linear-like (a 2-D weight and a bias), of a type no rule names: sharded only inside a column/row pair."""

    def __init__(self, features: int, out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(features, out))
        self.bias = nn.Parameter(torch.zeros(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


def test_a_split_that_keeps_most_parameters_whole_is_noted_with_the_reasons() -> None:
    epl.init()
    with epl.split(2):
        model = nn.Sequential(_Projection(16, 64), nn.LayerNorm(64), _Projection(64, 16))
    plan = epl.plan(model, world_size=2)
    text = str(plan)
    assert "    note: this device keeps 100% of the elements whole. Largest: 0.weight (1,024 elements: " in text
    assert "a linear-like layer in no column/row pair" in text or "in no pair the fx trace" in text
    rows = {row.name: row for row in plan.taskgraphs[0].shards[0]}
    assert rows["1.weight"].why == "vectors and buffers only: every device needs them whole"
    assert Plan.from_dict(__import__("json").loads(plan.to_json())) == plan
    # A Megatron MLP shards nearly everything: no note.
    with epl.split(2):
        mlp = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    assert "note: this device keeps" not in str(epl.plan(mlp, world_size=2))


def test_shard_rows_count_the_layers_alike() -> None:
    from epl.placement.shards import ShardRow, layer_pattern, summarise

    assert layer_pattern("model.layers.12.mlp.up_proj.weight") == "model.layers.*.mlp.up_proj.weight"
    up = ShardRow(name="", module="Linear", shape=(4, 2), whole=(8, 2), sharded=True)
    norm = ShardRow(name="", module="LayerNorm", shape=(2,), whole=(2,), sharded=False)
    held = [replace(row, name=f"layers.{i}.{row.module}.weight") for i in range(3) for row in (up, norm)]
    held += [replace(norm, name="0.bias", module="Linear"), replace(norm, name="1.bias")]  # not alike: modules differ
    held.append(replace(up, name="head.weight", tied=("embed.weight",)))
    rows = summarise(held)
    assert [(r.name, r.count) for r in rows] == [
        ("layers.*.Linear.weight", 3),
        ("layers.*.LayerNorm.weight", 3),
        ("0.bias", 1),
        ("1.bias", 1),
        ("head.weight", 1),
    ]
    assert rows[0].cells() == ["layers.*.Linear.weight", "[4, 2]", "of [8, 2]", "x3"]
    assert rows[1].cells() == ["layers.*.LayerNorm.weight", "[2]", "whole", "x3"]
    assert rows[4].cells() == ["head.weight (tied to embed.weight)", "[4, 2]", "of [8, 2]", ""]
    assert ShardRow.from_dict(__import__("json").loads(__import__("json").dumps(asdict(rows[4])))) == rows[4]


def test_plan_text_for_1024_devices_is_short() -> None:
    epl.init(epl.Config({"pipeline.num_micro_batch": 4}))
    model = examples.pipeline()
    text = str(epl.plan(model, world_size=1024, gpu_per_worker=8))
    assert "512 replicas x 2 devices per replica, 2 pipeline stages" in text
    assert "0, 2, 4, ..., 1022 (512 devices)" in text
    assert "1, 3, 5, ..., 1023 (512 devices)" in text
    assert "1022 more devices" in text
    assert len(text.splitlines()) < 30


def test_local_plan_checks_annotations_but_runs_everything_here() -> None:
    epl.init()
    model = examples.by_hand()
    plan = epl.plan(model)
    assert plan.local and plan.world_size == 1 and plan.num_stages == 1 and plan.num_replicas == 1
    assert plan.assignment(0).num_parameters == sum(p.numel() for p in model.parameters())
    assert "would run as 4 devices per replica" in plan.notes[0]


def test_local_plan_still_rejects_invalid_colocation() -> None:
    epl.init(epl.Config({"cluster.colocate_split_and_replicate": True}))
    with epl.replicate(2):
        a = nn.Linear(2, 2)
    with epl.split(4):
        b = nn.Linear(2, 2)
    with pytest.raises(epl.PlacementError, match="must be equal"):
        epl.plan(nn.Sequential(a, b))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, r"world_size=...\) takes a positive integer, got 0"),
        ({"world_size": 8.0}, r"world_size=...\) takes a positive integer, got 8.0"),
        ({"world_size": 8, "gpu_per_worker": -2}, r"gpu_per_worker=...\) takes a positive integer, got -2"),
    ],
)
def test_plan_arguments_are_checked(kwargs: dict[str, object], message: str) -> None:
    epl.init()
    with pytest.raises(epl.PlacementError, match=message):
        epl.plan(nn.Linear(2, 2), **kwargs)  # type: ignore[arg-type]


def test_plan_for_one_device_is_the_local_plan() -> None:
    epl.init()
    plan = epl.plan(examples.pipeline(), world_size=1)
    assert plan.local and plan.num_stages == 1


def test_plan_names_the_process_groups_of_split_stages() -> None:
    """TP 2 x PP 2 x DP 2 on 8 devices: Megatron's order (shards consecutive, then stages, then replicas)."""
    epl.init()
    with epl.split(2, name="stage_0"):
        first = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    with epl.split(2, name="stage_1"):
        second = nn.Linear(4, 2)
    plan = epl.plan(nn.Sequential(first, second), world_size=8)
    assert plan.process_groups() == {
        "tensor parallel": [(0, 1), (2, 3), (4, 5), (6, 7)],
        "pipeline": [(0, 2), (1, 3), (4, 6), (5, 7)],
        "data parallel": [(0, 4), (1, 5), (2, 6), (3, 7)],
    }
    text = str(plan)
    assert "process groups:\n  tensor parallel: [0, 1], [2, 3], [4, 5], [6, 7]\n" in text
    assert "  data parallel: [0, 4], [1, 5], [2, 6], [3, 7]\n" in text
    assert "  pipeline: [0, 2], [1, 3], [4, 6], [5, 7]\n" in text


def test_plan_counts_the_process_groups_beyond_a_few() -> None:
    epl.init()
    with epl.split(2):
        model = nn.Linear(4, 4)
    text = str(epl.plan(model, world_size=16))
    assert "  tensor parallel: [0, 1], [2, 3], [4, 5], [6, 7], ... (8 groups)\n" in text
    assert "  data parallel: [0, 2, 4, 6, 8, 10, 12, 14], [1, 3, 5, 7, 9, 11, 13, 15]\n" in text
    assert epl.plan(model, world_size=1).process_groups() == {}


def test_several_stages_per_rank_share_their_devices_round_robin() -> None:
    """pipeline.stages_per_rank=2: 4 split(2) stages on 2 device groups (stage s on group s % 2), 2 replicas."""
    specs = [spec(i, "split", 2) for i in range(4)]
    plan = place(specs, 8, **{"pipeline.stages_per_rank": 2})
    assert (plan.num_stages, plan.pipeline_size, plan.devices_per_replica, plan.num_replicas) == (4, 2, 4, 2)
    assert plan.devices(0, 0) == plan.devices(2, 0) == (0, 1) and plan.devices(3, 1) == (6, 7)
    assert plan.taskgraphs_on(2) == (1, 3)
    assert plan.assignment(0).num_parameters == 100  # half of stage 0 and half of stage 2
    assert plan.process_groups() == {
        "tensor parallel": [(0, 1), (2, 3), (4, 5), (6, 7)],
        "pipeline": [(0, 2), (1, 3), (4, 6), (5, 7)],
        "data parallel": [(0, 4), (1, 5), (2, 6), (3, 7)],
    }
    assert "4 pipeline stages (2 per device, on 2 device groups)" in str(plan)
    assert Plan.from_dict(plan.to_dict()) == plan


@pytest.mark.parametrize(
    ("specs", "config", "message"),
    [
        ([spec(i, "replicate", 1) for i in range(3)], {}, "must be a multiple of 2 with at least 2 groups"),
        ([spec(i, "replicate", 1) for i in range(2)], {}, "the model has 2 stage(s)"),
        ([spec(0, "split", 2), spec(1, "split", 2), spec(2, "replicate", 1), spec(3, "split", 2)], {}, "same device"),
        (
            [spec(i, "replicate", 1) for i in range(4)],
            {"cluster.colocate_split_and_replicate": True},
            "Set one of them back",
        ),
    ],
)
def test_stages_per_rank_that_cannot_place_say_why(
    specs: list[TaskGraphSpec], config: dict[str, object], message: str
) -> None:
    with pytest.raises(epl.PlacementError, match=message.replace("(", r"\(").replace(")", r"\)")):
        place(specs, 4, **{"pipeline.stages_per_rank": 2, **config})
