"""``epl.plan(...).memory`` / ``epl plan``: bytes per rank estimated without running equal what a run measures."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import epl
from epl.cli import make_cli
from epl.placement.plan_memory import OPTIMIZER_STATES, MemoryEstimate
from epl.runtime.memory import optimizer_state_bytes
from tests.helpers.distributed import run_ranks


def measured(report: Any) -> tuple[int, int, int]:
    return report.parameter_bytes, report.gradient_bytes, report.optimizer_state_bytes


def estimated(estimate: MemoryEstimate) -> tuple[int, int, int | None]:
    return estimate.parameter_bytes, estimate.gradient_bytes, estimate.optimizer_state_bytes


# -- the optimizer table, against torch ---------------------------------------------------------

CASES: list[tuple[str, dict[str, Any]]] = [
    ("SGD", {"lr": 0.1}),
    ("SGD", {"lr": 0.1, "momentum": 0.9}),
    ("Adam", {}),
    ("Adam", {"amsgrad": True}),
    ("AdamW", {}),
    ("Adamax", {}),
    ("NAdam", {}),
    ("RAdam", {}),
    ("Adagrad", {}),
    ("Adadelta", {}),
    ("RMSprop", {}),
    ("RMSprop", {"momentum": 0.9, "centered": True}),
    ("Rprop", {}),
    ("ASGD", {}),
]


def test_every_table_entry_is_tested() -> None:
    assert {name for name, _ in CASES} == set(OPTIMIZER_STATES)


@pytest.mark.parametrize(("name", "options"), CASES, ids=[f"{n}{o}" for n, o in CASES])
def test_optimizer_table_matches_the_state_torch_keeps(name: str, options: dict[str, Any]) -> None:
    """One process: the estimate equals what memory_report counts after a step, for each optimizer."""
    epl.init()
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    model[2].bias.requires_grad_(False)  # frozen: no gradient, no state

    def factory(params: Any) -> torch.optim.Optimizer:
        return getattr(torch.optim, name)(params, **options)

    plan = epl.plan(model, optimizer=factory)
    engine = epl.parallelize(model, optimizer=factory, loss_fn=nn.MSELoss())
    engine.step(torch.randn(4, 5), torch.randn(4, 3))
    assert estimated(plan.memory[0]) == measured(engine.memory_report())
    assert optimizer_state_bytes(engine.optimizer) == plan.memory[0].optimizer_state_bytes


def test_an_optimizer_given_built_counts_its_groups_options() -> None:
    epl.init()
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    optimizer = torch.optim.SGD(
        [{"params": model[0].parameters(), "momentum": 0.9}, {"params": model[1].parameters()}], lr=0.1
    )
    estimate = epl.plan(model, optimizer=optimizer).memory[0]
    assert estimate.optimizer_state_bytes == 4 * (4 * 6 + 6)  # momentum buffers of the first group only


def test_unknown_optimizer_and_no_optimizer() -> None:
    class MyAdam(torch.optim.Adam):
        pass

    epl.init()
    model = nn.Linear(4, 4)
    unknown = epl.plan(model, world_size=2, optimizer=lambda p: MyAdam(p)).memory
    assert [m.optimizer_state_bytes for m in unknown] == [None, None] and unknown[0].total_bytes is None
    assert "MyAdam is not in epl.placement.plan_memory.OPTIMIZER_STATES" in unknown[0].notes[0]
    assert "unknown" in str(epl.plan(model, world_size=2, optimizer=MyAdam))
    bare = epl.plan(model, world_size=2).memory[1]
    assert estimated(bare) == (80, 80, 0) and bare.total_bytes == 160
    assert "no optimizer" in bare.notes[0] and "activations not estimated" in str(bare)


def test_memory_of_1024_devices_is_per_rank_and_json_round_trips() -> None:
    epl.init(epl.Config({"pipeline.num_micro_batch": 4}))
    with epl.replicate(1, name="stage_0"):
        first = nn.Linear(12, 256)
    with epl.replicate(1, name="stage_1"):
        second = nn.Linear(256, 12)
    plan = epl.plan(nn.Sequential(first, second), world_size=1024, gpu_per_worker=8, optimizer=torch.optim.Adam)
    assert len(plan.memory) == 1024 and [m.rank for m in plan.memory[:3]] == [0, 1, 2]
    psi = [12 * 256 + 256, 256 * 12 + 12]
    for rank in (0, 1, 1022, 1023):
        assert estimated(plan.memory[rank]) == (4 * psi[rank % 2], 4 * psi[rank % 2], 8 * psi[rank % 2])
    assert epl.Plan.from_dict(json.loads(plan.to_json())) == plan
    text = str(plan)
    assert "memory per device (estimated; activations are not estimated)" in text
    assert len(text.splitlines()) < 40


def test_split_shards_come_from_the_split_rules() -> None:
    """Column then row parallel: the row-parallel bias and the LayerNorm stay whole; 15 features shard 8 + 7."""
    epl.init()
    with epl.split(2, name="mlp"):
        model = nn.Sequential(nn.Linear(8, 15), nn.ReLU(), nn.Linear(15, 6), nn.LayerNorm(6))
    plan = epl.plan(model, world_size=2, optimizer=torch.optim.SGD)
    numels = [8 * 8 + 8 + 6 * 8 + 6 + 12, 7 * 8 + 7 + 6 * 7 + 6 + 12]
    assert [m.parameter_bytes for m in plan.memory] == [4 * n for n in numels]
    assert [plan.assignment(d).num_parameters for d in range(2)] == numels  # the Plan's shards, refined


def test_split_module_no_rule_covers_fails_the_plan_as_it_would_fail_the_run() -> None:
    class Mixer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mixing = nn.Parameter(torch.ones(5, 3))

    epl.init()
    with epl.split(2, name="odd"):
        model = Mixer()
    with pytest.raises(epl.AnnotationError, match="no split rule says how to shard that type"):
        epl.plan(model, world_size=2)


class Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mixing = nn.Parameter(torch.ones(5, 3))


def register_rule(rule: Callable[[nn.Module, Any], nn.Module]) -> None:
    class Rules:
        @epl.hookimpl
        def epl_split_rules(self) -> dict[type[nn.Module], Any]:
            return {Mixer: rule}

    epl.Env.get().plugins.register(Rules(), name="mixer-rules")


def test_rule_that_needs_the_devices_is_estimated_along_dimension_0() -> None:
    def communicates(module: nn.Module, shard: Any) -> nn.Module:
        shard.group.communicator.all_reduce(module.mixing)
        return module

    epl.init()
    register_rule(communicates)
    with epl.split(2, name="odd"):
        model = Mixer()
    plan = epl.plan(model, world_size=2)
    assert "odd: parameters sharded along dimension 0 as an estimate" in plan.memory[0].notes[-1]
    assert [[(r.name, r.shape, r.whole) for r in rows] for rows in plan.taskgraphs[0].shards] == [
        [("mixing", (3, 3), (5, 3))],
        [("mixing", (2, 3), (5, 3))],
    ]


def test_rule_raising_an_epl_error_fails_the_plan_as_it_would_fail_the_run() -> None:
    def refuses(module: nn.Module, shard: Any) -> nn.Module:
        raise epl.ConfigError("mixing needs mixer.heads to divide the devices")

    epl.init()
    register_rule(refuses)
    with epl.split(2, name="odd"):
        model = Mixer()
    with pytest.raises(epl.ConfigError, match="mixer.heads"):
        epl.plan(model, world_size=2)


def test_linear_like_module_alone_is_estimated_whole() -> None:
    """A 2-D ``weight`` of a type no rule names is linear-like: kept whole unless a column/row region holds it."""

    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(5, 3))

    epl.init()
    with epl.split(2, name="odd"):
        model = Scale()
    memory = epl.plan(model, world_size=2).memory
    assert [m.parameter_bytes for m in memory] == [4 * 15, 4 * 15]


# -- the estimate against memory_report on real processes ---------------------------------------


def _data_parallel() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 20), nn.Tanh(), nn.Linear(20, 9), nn.Tanh(), nn.Linear(9, 3))
    model[0].bias.requires_grad_(False)
    return model


def _split() -> nn.Module:
    torch.manual_seed(0)
    with epl.split(2, name="mlp"):
        return nn.Sequential(nn.Linear(6, 15), nn.ReLU(), nn.Linear(15, 3), nn.LayerNorm(3))


def _pipeline() -> nn.Module:
    torch.manual_seed(0)
    with epl.replicate(1, name="stage_0"):
        first = nn.Sequential(nn.Linear(6, 32), nn.ReLU())
    with epl.replicate(1, name="stage_1"):
        second = nn.Linear(32, 3)
    return nn.Sequential(first, second)


def _split_and_replicate() -> nn.Module:
    """The manual's recipe: a replicate(2) body and a split(2) head on the same two devices."""
    torch.manual_seed(0)
    with epl.replicate(2, name="body"):
        body = nn.Sequential(nn.Linear(6, 10), nn.Tanh())
    with epl.split(2, name="head"):
        head = nn.Sequential(nn.Linear(10, 7), nn.ReLU(), nn.Linear(7, 3))
    return nn.Sequential(body, head)


LAYOUTS: dict[str, tuple[Callable[[], nn.Module], dict[str, Any]]] = {
    "data_parallel": (_data_parallel, {}),
    "split": (_split, {}),
    "pipeline": (_pipeline, {"pipeline.num_micro_batch": 2}),
    "split_and_replicate": (_split_and_replicate, {"cluster.colocate_split_and_replicate": True}),
}


def estimate_then_train(layout: str) -> dict[str, Any]:
    """On each rank: the estimate of epl.plan, then what memory_report measures after one Adam step."""
    build, config = LAYOUTS[layout]
    env = epl.init(epl.Config(config))
    model = build()
    factory = lambda params: torch.optim.Adam(params, lr=0.01)  # noqa: E731
    plan = epl.plan(model, optimizer=factory)
    engine = epl.parallelize(model, optimizer=factory, loss_fn=nn.MSELoss())
    engine.step(torch.randn(8, 6), torch.randn(8, 3))
    return {"estimate": plan.memory[env.cluster.rank], "report": engine.memory_report()}


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_estimate_equals_memory_report_on_two_processes(layout: str) -> None:
    results = run_ranks(estimate_then_train, 2, layout, timeout=120)
    for result in results:
        assert estimated(result["estimate"]) == measured(result["report"])
    if layout in ("split", "pipeline"):  # the ranks hold different tensors
        assert results[0]["estimate"].parameter_bytes != results[1]["estimate"].parameter_bytes


# -- epl plan -------------------------------------------------------------------------------------


def run(*args: str) -> Any:
    return CliRunner().invoke(make_cli(), list(args))


def test_plan_command_prints_the_memory_per_device() -> None:
    result = run("plan", "-n", "4", "--example", "pipeline", "--optimizer", "adam")
    assert result.exit_code == 0, result.output
    assert "memory per device (estimated; activations are not estimated)" in result.output
    assert "optimizer states: Adam keeps exp_avg, exp_avg_sq" in result.output
    result = run("plan", "-n", "4", "--example", "pipeline", "--json")
    memory = json.loads(result.output)["memory"]
    psi = 12 * 256 + 256 + 256 * 64 + 64  # stage_0
    assert (memory[2]["parameter_bytes"], memory[2]["gradient_bytes"], memory[2]["optimizer_state_bytes"]) == (
        4 * psi,
        4 * psi,
        0,
    )
    result = run("plan", "-n", "4", "--example", "pipeline", "--optimizer", "Adafactor9")
    assert result.exit_code == 1 and "No optimizer 'Adafactor9' to estimate with; known: SGD, Adam" in result.output


def test_plan_command_estimates_with_the_scripts_optimizer(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import torch, epl\n"
        "from torch import nn\n"
        "epl.init()\n"
        "model = nn.Linear(10, 10)\n"
        "epl.parallelize(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))\n"
    )
    result = run("plan", "-n", "2", "--json", str(script))
    assert result.exit_code == 0, result.output
    memory = json.loads(result.stdout)["memory"]
    assert [(m["rank"], m["optimizer_state_bytes"]) for m in memory] == [(0, 440), (1, 440)]  # one momentum buffer
    result = run("plan", "-n", "2", "--json", "--optimizer", "Adam", str(script))
    assert json.loads(result.stdout)["memory"][0]["optimizer_state_bytes"] == 880
