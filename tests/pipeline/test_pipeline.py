"""The manual's two-stage pipeline on real processes equals the local run on the same global batch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from epl.plugins import hookimpl
from tests.helpers.distributed import run_ranks
from tests.helpers.reference import assert_rank_matches, train_locally

pytestmark = pytest.mark.multiprocess

MICRO, REPLICA_BATCH, STEPS = 4, 8, 3


def build() -> nn.Module:
    import epl

    torch.manual_seed(0)
    with epl.replicate(device_count=1, name="stage_0"):
        stage0 = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU())
    with epl.replicate(device_count=1, name="stage_1"):
        stage1 = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 12))
    return nn.Sequential(stage0, stage1).double()


def batches(replicas: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    size = replicas * REPLICA_BATCH
    return [
        (
            torch.randn(size, 12, generator=generator, dtype=torch.float64),
            torch.randn(size, 12, generator=generator, dtype=torch.float64),
        )
        for _ in range(STEPS)
    ]


def split_out_of_order(num_stages: int, num_micro_batches: int) -> list[list[Any]]:
    """GPipe with each backward split, the input gradients in reverse order and the weight gradients after them
    in forward order (the first stage's W's then run in another order than its I's)."""
    from epl.plugin_api import Action, ActionKind

    forwards, inputs, weights = (ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT)
    micro = range(num_micro_batches)
    return [
        [Action(s, forwards, m) for m in micro]
        + [Action(s, inputs, m) for m in reversed(micro)]
        + [Action(s, weights, m) for m in micro]
        for s in range(num_stages)
    ]


class ThirdPartySchedules:
    """A plugin that adds schedules through the hook (GPipe under another name, and a split one)."""

    @hookimpl
    def epl_pipeline_schedules(self) -> dict[str, Any]:
        """Register ``MySchedule`` and ``MySplitSchedule``."""
        from epl_pipeline.schedules import gpipe

        return {"MySchedule": gpipe, "MySplitSchedule": split_out_of_order}


def train(strategy: str) -> dict[str, Any]:
    import epl
    from epl.plugins import get_plugin_manager

    if strategy.startswith("My"):
        get_plugin_manager().register(ThirdPartySchedules(), name="third-party-schedules")
    epl.init(epl.Config({"pipeline.num_micro_batch": MICRO, "pipeline.strategy": strategy}))
    engine = epl.parallelize(build(), optimizer=lambda p: torch.optim.Adam(p, lr=1e-2), loss_fn=nn.MSELoss())
    losses = []
    for x, y in batches(engine.num_replicas):
        share = slice(engine.replica_index * REPLICA_BATCH, (engine.replica_index + 1) * REPLICA_BATCH)
        losses.append(float(engine.step(x[share], y[share])))
    runner = engine.context.step_runner
    return {
        "losses": losses,
        "stage": runner.stage,
        "peak_in_flight": runner.peak_in_flight,
        "replica": engine.replica_index,
        "replicas": engine.num_replicas,
        "state": {k: v.clone() for k, v in engine.model.state_dict().items()},
    }


def reference(replicas: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    import epl

    epl.init()
    model = build()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    return train_locally(model, optimizer, batches(replicas), MICRO * replicas)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("strategy", ["PreferForward", "PreferBackward", "ZeroBubble", "MySchedule", "MySplitSchedule"])
def test_pipeline_equals_the_local_run(world_size: int, strategy: str) -> None:
    ranks = run_ranks(train, world_size, strategy, timeout=180)
    replicas = ranks[0]["replicas"]
    assert replicas == world_size // 2
    expected_losses, expected_state = reference(replicas)
    per_replica = {r["replica"]: r["losses"] for r in ranks}
    mean = torch.tensor([per_replica[i] for i in range(replicas)], dtype=torch.float64).mean(0)
    torch.testing.assert_close(mean, torch.tensor(expected_losses, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    for rank, result in enumerate(ranks):
        assert result["losses"] == per_replica[result["replica"]]  # every stage returns the replica's loss
        for name, value in result["state"].items():
            torch.testing.assert_close(value, expected_state[name], rtol=1e-12, atol=1e-12, msg=f"rank {rank} {name}")
        assert len(result["state"]) == 4  # only this stage's two Linear layers are kept
        # activations are freed after their backward: micro-batches held at once, measured
        peak = {"PreferForward": MICRO, "PreferBackward": 2 - result["stage"], "ZeroBubble": 2}
        peak |= {"MySchedule": MICRO, "MySplitSchedule": MICRO}
        assert result["peak_in_flight"] == peak[strategy]


def train_by_hand(out: str) -> dict[str, Any]:
    """The eight-layer model of pytorch_model_parallel_by_hand.md, four stages, no .to(device)."""
    import epl
    from epl.examples.manual import by_hand

    epl.init(epl.Config({"pipeline.num_micro_batch": MICRO}))
    torch.manual_seed(0)
    engine = epl.parallelize(by_hand().double(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.MSELoss())
    losses = [float(engine.step(x, y)) for x, y in batches(1)]
    from epl_pipeline.recording import gather_timeline, save_timeline

    events = gather_timeline(engine)
    bubble = save_timeline(engine, Path(out) / "timeline")
    assert save_timeline(engine, Path(out) / "svg" / "timeline", picture=".svg") == bubble
    return {
        "losses": losses,
        "state": {k: v.clone() for k, v in engine.model.state_dict().items()},
        "events": sorted(str(e.action) for e in events),
        "ordered": all(e.start <= e.end for e in events),
        "bubble": bubble,
    }


def test_four_stages_of_the_by_hand_model_and_its_recorded_timeline(tmp_path: Path) -> None:
    import epl
    from epl.examples.manual import by_hand

    ranks = run_ranks(train_by_hand, 4, str(tmp_path), timeout=180)
    epl.init()
    torch.manual_seed(0)
    model = by_hand().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    expected, full = train_locally(model, optimizer, batches(1), MICRO)
    for result in ranks:
        assert_rank_matches(result, expected, full, 1e-12)
        assert len(result["state"]) == 4  # two Linear layers per stage
        assert result["events"] == sorted(f"{s}{k}{m}" for s in range(4) for k in "FB" for m in range(MICRO))
        assert result["ordered"] and 0 < result["bubble"] < 1
        assert result["bubble"] == ranks[0]["bubble"]
    assert json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    assert (tmp_path / "timeline.png").read_bytes().startswith(b"\x89PNG")
    svg = (tmp_path / "svg" / "timeline.svg").read_text()  # the same picture, with its text kept as text
    assert "measured step" in svg and f"measured bubble {ranks[0]['bubble']:.1%}" in svg
    assert "time since the step's start (ms)" in svg and all(f"stage {s}" in svg for s in range(4))
    assert not (tmp_path / "svg" / "timeline.png").exists()


def bert_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(11)
    return [
        (
            torch.randint(0, 1000, (REPLICA_BATCH, 6), generator=generator),
            torch.randn(REPLICA_BATCH, 6, 2, generator=generator, dtype=torch.float64),
        )
        for _ in range(STEPS)
    ]


def bert_model() -> nn.Module:
    """The manual's BERT recipe (each set_default_strategy call opens a stage), dropout off to compare runs."""
    from epl.examples.manual import bert_stages

    torch.manual_seed(0)
    model = bert_stages().double()
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(module, nn.MultiheadAttention):
            module.dropout = 0.0  # a float, not a module
    return model


def train_bert(strategy: str) -> dict[str, Any]:
    import epl

    epl.init(epl.Config({"pipeline.num_micro_batch": MICRO, "pipeline.strategy": strategy}))
    engine = epl.parallelize(bert_model(), optimizer=lambda p: torch.optim.Adam(p, lr=1e-3), loss_fn=nn.MSELoss())
    losses = [float(engine.step(x, y)) for x, y in bert_batches()]
    return {"losses": losses, "state": {k: v.clone() for k, v in engine.model.state_dict().items()}}


@pytest.mark.parametrize("strategy", ["PreferBackward", "ZeroBubble"])
def test_the_bert_recipe_with_set_default_strategy_stages(strategy: str) -> None:
    import epl

    ranks = run_ranks(train_bert, 2, strategy, timeout=180)
    epl.init()
    model = bert_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    expected, full = train_locally(model, optimizer, bert_batches(), MICRO)
    assert sum(len(r["state"]) for r in ranks) == len(full)
    for result in ranks:
        assert_rank_matches(result, expected, full, 1e-10)
