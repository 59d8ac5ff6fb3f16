"""Capture of the manual's annotations into TaskGraphs through PyTorch's registration hooks."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_hooks

import epl
from epl.examples import manual as examples


def taskgraphs(model: nn.Module) -> list[epl.TaskGraph]:
    return epl.Env.get().annotations.taskgraphs_for(model)


def summary(model: nn.Module) -> list[tuple[str, str, int, bool]]:
    return [(tg.name, tg.strategy.kind, tg.strategy.device_count, tg.implicit) for tg in taskgraphs(model)]


def owned(tg: epl.TaskGraph) -> set[int]:
    return {id(t) for t in tg.tensors}


def test_data_parallel_example_is_one_replicate_taskgraph() -> None:
    epl.init()
    model = examples.data_parallel()
    (tg,) = taskgraphs(model)
    assert (tg.strategy.kind, tg.strategy.device_count, tg.implicit) == ("replicate", 1, False)
    assert owned(tg) == {id(p) for p in model.parameters()}
    assert tg.modules == ["0", "1"]


def test_pipeline_example_has_two_stages_and_container_owns_nothing() -> None:
    epl.init(epl.Config({"pipeline.num_micro_batch": 4}))
    model = examples.pipeline()
    stage0, stage1 = taskgraphs(model)
    assert (stage0.name, stage1.name) == ("stage_0", "stage_1")
    assert owned(stage0) == {id(p) for p in model[0].parameters()}
    assert owned(stage1) == {id(p) for p in model[1].parameters()}
    assert stage0.modules == ["0.0", "0.2"] and stage1.modules == ["1.0", "1.2"]


def test_bert_example_each_set_default_strategy_opens_a_taskgraph() -> None:
    epl.init()
    model = examples.bert_stages()
    first, second = taskgraphs(model)
    assert not first.implicit and not second.implicit
    assert owned(first) == {id(t) for t in [*model[0].parameters(), *model[0].buffers()]}
    assert owned(second) == {id(t) for t in [*model[1].parameters(), *model[1].buffers()]}


def test_colocated_classification_example() -> None:
    epl.init(epl.Config({"cluster.colocate_split_and_replicate": True}))
    model = examples.classification()
    assert summary(model) == [("features", "replicate", 1, False), ("classifier", "split", 1, False)]
    features, classifier = taskgraphs(model)
    assert owned(classifier) == {id(p) for p in model[1].parameters()}
    # BatchNorm buffers belong to the features TaskGraph too.
    assert {id(b) for b in model[0].buffers()} <= owned(features)


def test_moe_example_default_resumes_after_split_scope() -> None:
    epl.init(epl.Config({"cluster.colocate_split_and_replicate": True}))
    model = examples.moe()
    default, experts = taskgraphs(model)
    assert (default.strategy.kind, experts.strategy.kind) == ("replicate", "split")
    assert owned(experts) == {id(p) for p in model.moe.experts.parameters()}
    assert owned(default) == {id(p) for p in [*model.attention.parameters(), *model.moe.gate.parameters()]}


def test_modules_after_scope_return_to_the_same_default_taskgraph() -> None:
    epl.init()
    epl.set_default_strategy(epl.replicate(2))
    a = nn.Linear(2, 2)
    with epl.split(2):
        b = nn.Linear(2, 2)
    c = nn.Linear(2, 2)
    model = nn.Sequential(a, b, c)
    default, split = taskgraphs(model)
    assert owned(default) == {id(p) for p in [*a.parameters(), *c.parameters()]}
    assert owned(split) == {id(p) for p in b.parameters()}


def test_unannotated_modules_form_implicit_replicate_taskgraphs() -> None:
    before = nn.Linear(3, 3)  # created before epl.init
    epl.init()
    early = nn.Linear(3, 3)
    with epl.replicate(1, name="middle"):
        middle = nn.Linear(3, 3)
    late = nn.Linear(3, 3)
    model = nn.Sequential(before, early, middle, late)
    assert summary(model) == [
        ("implicit_0", "replicate", 1, True),
        ("middle", "replicate", 1, False),
        ("implicit_2", "replicate", 1, True),
    ]
    first, _, last = taskgraphs(model)
    assert owned(first) == {id(p) for p in [*before.parameters(), *early.parameters()]}
    assert owned(last) == {id(p) for p in late.parameters()}


def test_model_without_annotations_is_one_implicit_taskgraph() -> None:
    epl.init()
    model = nn.Linear(2, 2)
    assert summary(model) == [("implicit_0", "replicate", 1, True)]


def test_set_default_strategy_none_returns_to_implicit() -> None:
    epl.init()
    epl.set_default_strategy(epl.replicate(1, name="a"))
    a = nn.Linear(2, 2)
    epl.set_default_strategy(None)
    b = nn.Linear(2, 2)
    assert summary(nn.Sequential(a, b)) == [("a", "replicate", 1, False), ("implicit_1", "replicate", 1, True)]


def test_tied_parameter_stays_with_its_first_taskgraph() -> None:
    epl.init()
    with epl.replicate(1, name="a"):
        embed = nn.Embedding(10, 4)
    with epl.replicate(1, name="b"):
        head = nn.Linear(4, 10, bias=False)
    head.weight = embed.weight  # re-registration does not move it
    first, second = taskgraphs(nn.Sequential(embed, head))
    assert id(embed.weight) in owned(first) and not second.tensors


def test_container_in_a_scope_takes_the_layers_built_outside_any_scope() -> None:
    # Issue 27: layers built outside any scope belong to the stage whose container holds them.
    epl.init(epl.Config({"pipeline.num_micro_batch": 2}))
    layers = [nn.Linear(8, 8) for _ in range(16)]
    with epl.replicate(1, name="stage_0"):
        a = nn.Sequential(*layers[:8])
    with epl.replicate(1, name="stage_1"):
        b = nn.Sequential(*layers[8:])
    model = nn.Sequential(a, b)
    assert summary(model) == [("stage_0", "replicate", 1, False), ("stage_1", "replicate", 1, False)]
    stage0, stage1 = taskgraphs(model)
    assert owned(stage0) == {id(p) for p in a.parameters()} and len(stage0.tensors) == 16
    assert owned(stage1) == {id(p) for p in b.parameters()} and len(stage1.tensors) == 16
    plan = epl.plan(model, world_size=2)
    assert (plan.num_replicas, plan.devices_per_replica, plan.num_stages) == (1, 2, 2)
    assert [tg.name for tg in plan.taskgraphs] == ["stage_0", "stage_1"]
    assert plan.devices(0) == (0,) and plan.devices(1) == (1,)


def test_container_in_a_scope_leaves_annotated_modules_where_they_were_built() -> None:
    epl.init()
    with epl.replicate(1, name="stage_0"):
        embed = nn.Embedding(10, 4)
    loose = nn.Linear(4, 4)
    with epl.replicate(1, name="stage_1"):
        head = nn.Linear(4, 10, bias=False)
        head.weight = embed.weight  # tied: stays in stage_0
        container = nn.Sequential(embed, loose, head)
    stage0, stage1 = taskgraphs(container)
    assert (stage0.name, stage1.name) == ("stage_0", "stage_1")
    assert owned(stage0) == {id(embed.weight)}
    assert owned(stage1) == {id(p) for p in loose.parameters()}


def test_container_in_a_scope_takes_modules_built_before_init() -> None:
    before = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    epl.init()
    with epl.split(2, name="tp"):
        container = nn.Sequential(before, nn.Linear(3, 3))
    (tp,) = taskgraphs(container)
    assert tp.name == "tp" and not tp.implicit
    assert owned(tp) == {id(t) for t in [*container.parameters(), *container.buffers()]}
    container.half()  # new tensors in the same slots keep the membership
    assert [tg.name for tg in taskgraphs(container)] == ["tp"]


def test_container_under_a_default_strategy_takes_unannotated_modules() -> None:
    epl.init()
    early = nn.Linear(3, 3)
    with epl.replicate(1, name="scoped"):
        scoped = nn.Linear(3, 3)
    epl.set_default_strategy(epl.replicate(2, name="default"))
    model = nn.Sequential(early, scoped, nn.Linear(3, 3))
    scoped_tg, default = taskgraphs(model)
    assert (scoped_tg.name, default.name) == ("scoped", "default")
    assert owned(scoped_tg) == {id(p) for p in scoped.parameters()}
    assert owned(default) == {id(p) for p in [*early.parameters(), *model[2].parameters()]}


def test_container_outside_any_annotation_changes_nothing() -> None:
    before = nn.Linear(3, 3)
    epl.init()
    early = nn.Linear(3, 3)
    with epl.replicate(1, name="middle"):
        middle = nn.Linear(3, 3)
    model = nn.Sequential(before, early, middle)
    model.append(nn.Sequential(nn.Linear(3, 3)))
    assert summary(model) == [
        ("implicit_0", "replicate", 1, True),
        ("middle", "replicate", 1, False),
        ("implicit_2", "replicate", 1, True),
    ]
    first, _, last = taskgraphs(model)
    assert owned(first) == {id(p) for p in [*before.parameters(), *early.parameters()]}
    assert owned(last) == {id(p) for p in model[3].parameters()}


def test_nesting_is_an_error() -> None:
    epl.init()
    with (
        epl.replicate(1),
        pytest.raises(
            epl.AnnotationError,
            match=r"Nested annotations are not allowed: split\(2\) was opened inside replicate\(1\)",
        ),
    ):
        with epl.split(2):
            pass


def test_set_default_strategy_inside_scope_is_an_error() -> None:
    epl.init()
    with epl.replicate(1), pytest.raises(epl.AnnotationError, match="inside the scope"):
        epl.set_default_strategy(epl.replicate(1))


def test_duplicate_names_are_an_error() -> None:
    epl.init()
    with epl.replicate(1, name="stage_0"):
        pass
    with pytest.raises(epl.AnnotationError, match="Two annotations are named 'stage_0'"):
        with epl.replicate(1, name="stage_0"):
            pass


@pytest.mark.parametrize("count", [0, -1, 1.5, True, None])
def test_device_count_must_be_a_positive_integer(count: object) -> None:
    with pytest.raises(epl.AnnotationError, match="positive integer device count"):
        epl.replicate(count)  # type: ignore[arg-type]


def test_set_default_strategy_rejects_other_objects() -> None:
    epl.init()
    with pytest.raises(epl.AnnotationError, match="takes epl.replicate"):
        epl.set_default_strategy("replicate")  # type: ignore[arg-type]


def test_annotations_before_init_are_an_error() -> None:
    with pytest.raises(epl.NotInitializedError, match=r"call epl.init\(\)"):
        with epl.replicate(1):
            pass
    with pytest.raises(epl.NotInitializedError):
        epl.Env.get()


def test_hooks_are_installed_by_init_and_removed_by_parallelize() -> None:
    before = len(module_hooks._global_parameter_registration_hooks)
    epl.init()
    assert len(module_hooks._global_parameter_registration_hooks) == before + 1
    with epl.replicate(1):
        model = nn.Linear(2, 2)
    epl.parallelize(model, optimizer=lambda p: __import__("torch").optim.SGD(p, lr=0.1))
    assert len(module_hooks._global_parameter_registration_hooks) == before
    assert len(module_hooks._global_buffer_registration_hooks) == 0
    assert len(module_hooks._global_module_registration_hooks) == 0
    with pytest.raises(epl.AnnotationError, match="after epl.parallelize"):
        with epl.replicate(1):
            pass


def test_second_init_starts_over() -> None:
    first = epl.init(epl.Config({"pipeline.num_micro_batch": 2}))
    with epl.replicate(1, name="old"):
        nn.Linear(2, 2)
    second = epl.init()
    assert epl.Env.get() is second and second is not first
    assert not first.annotations.installed
    assert second.config["pipeline.num_micro_batch"] == 1
    assert len(module_hooks._global_parameter_registration_hooks) == 1
    with epl.replicate(1, name="old"):  # the old name is free again
        model = nn.Linear(2, 2)
    assert summary(model) == [("old", "replicate", 1, False)]


def test_membership_survives_tensor_replacement() -> None:
    epl.init()
    with epl.replicate(1, name="s0"):
        a = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    with epl.replicate(1, name="s1"), torch.device("meta"):
        b = nn.Linear(3, 3)
    model = nn.Sequential(a, b)
    b.to_empty(device="cpu")  # new parameter objects in the same slots
    a.half()  # new buffer objects
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    s0, s1 = taskgraphs(model)
    assert (s0.name, s1.name) == ("s0", "s1")
    assert owned(s0) == {id(t) for t in [*a.parameters(), *a.buffers()]}
    assert owned(s1) == {id(t) for t in b.parameters()}


def test_taskgraphs_of_another_model_are_not_part_of_this_one() -> None:
    epl.init()
    with epl.replicate(1, name="teacher"):
        nn.Linear(4, 4)
    with epl.replicate(1, name="student"):
        student = nn.Linear(4, 4)
    with epl.replicate(1, name="empty"):
        pass
    assert [tg.name for tg in taskgraphs(student)] == ["student", "empty"]


def test_recorder_keeps_nothing_alive() -> None:
    epl.init()
    with epl.replicate(1):
        throwaway = nn.Linear(64, 64)
    alive = weakref.ref(throwaway.weight)
    del throwaway
    gc.collect()
    assert alive() is None
