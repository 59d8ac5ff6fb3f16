"""Checkpoints saved under one layout load under any other, and resume exactly."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import epl
from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.multiprocess

ROWS = 8


class Net(nn.Module):
    """The same names under every layout: ``front.*`` and ``back.*``."""

    def __init__(self, stages: str = "", dropout: float = 0.0) -> None:
        super().__init__()
        with stage(stages, "stage_0"):
            self.front = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
        with stage(stages, "stage_1"):
            self.back = nn.Sequential(nn.Dropout(dropout), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.back(self.front(x))


def stage(kind: str, name: str) -> Any:
    """The annotation of a pipeline stage: ``replicate`` (one device), ``split`` (two), or none ("")."""
    if kind == "replicate":
        return epl.replicate(1, name=name)
    return epl.split(2, name=name) if kind == "split" else nullcontext()


LAYOUTS: dict[str, dict[str, Any]] = {
    "local": {},
    "data parallel": {},
    "pipeline 2x2": {"stages": "replicate", "config": {"pipeline.num_micro_batch": 2}},
    "split stages": {"stages": "split", "config": {"pipeline.num_micro_batch": 2}},
    "split": {"split": True},
    "zero v2": {"config": {"zero.level": "v2"}},
    "amp": {"config": {"amp.level": "O1", "amp.growth_interval": 1}},
}


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return (
        torch.randn(ROWS, 8, generator=generator, dtype=torch.float64),
        torch.randn(ROWS, 4, generator=generator, dtype=torch.float64),
    )


def engine_for(layout: str, dropout: float = 0.0) -> epl.Engine:
    options = LAYOUTS[layout]
    epl.init(epl.Config(options.get("config", {})))
    torch.manual_seed(0)
    with epl.split(2) if options.get("split") else nullcontext():
        model = Net(options.get("stages", ""), dropout).double()
    return epl.parallelize(model, optimizer=lambda p: torch.optim.AdamW(p, lr=0.01), loss_fn=nn.MSELoss())


def step(engine: epl.Engine, index: int) -> float:
    x, y = batch(index)
    share = ROWS // engine.num_replicas
    rows = slice(share * engine.replica_index, share * (engine.replica_index + 1))
    return float(engine.step(x[rows], y[rows]))


def whole(engine: epl.Engine) -> dict[str, torch.Tensor]:
    return {key: value.clone() for key, value in engine.state_dict(full=True)["model"].items()}


def save_after_two_steps(layout: str, path: Path) -> None:
    engine = engine_for(layout)
    step(engine, 0)
    step(engine, 1)
    engine.save(path)


def load_and_step(layout: str, path: Path) -> dict[str, Any]:
    """The weights as loaded, and after one more step (on the third batch)."""
    engine = engine_for(layout)
    engine.load(path)
    loaded = whole(engine)
    step(engine, 2)
    return {"loaded": loaded, "after": whole(engine), "global_step": engine.global_step}


def four_processes(folder: str) -> dict[str, Any]:
    root = Path(folder)
    save_after_two_steps("pipeline 2x2", root / "pipeline")
    results = {layout: load_and_step(layout, root / "pipeline") for layout in ("data parallel", "zero v2")}
    save_after_two_steps("zero v2", root / "zero")
    results["pipeline 2x2 from zero v2"] = load_and_step("pipeline 2x2", root / "zero")
    save_after_two_steps("split stages", root / "3d")
    results["data parallel from split stages"] = load_and_step("data parallel", root / "3d")
    results["split stages from zero v2"] = load_and_step("split stages", root / "zero")
    return results


def two_processes(folder: str) -> dict[str, Any]:
    root = Path(folder)
    results = {"split": load_and_step("split", root / "pipeline")}
    save_after_two_steps("split", root / "split")
    return results


def test_a_checkpoint_loads_under_every_layout(tmp_path: Path) -> None:
    """Saved as a 2-stage pipeline x 2 replicas, as ZeRO v2 over 4, as split over 2 and as 2 split(2) stages
    (TP 2 x PP 2); loaded as 4 replicas, ZeRO v2 over 4, split over 2, a pipeline, split stages and one local
    process: every load
    holds the saved weights and takes the uninterrupted run's next step (optimizer state included)."""
    reference = engine_for("local")
    step(reference, 0)
    step(reference, 1)
    at_save = whole(reference)
    step(reference, 2)
    expected = whole(reference)

    loads: list[dict[str, Any]] = []
    for rank_results in run_ranks(four_processes, 4, str(tmp_path), timeout=300):
        loads += rank_results.values()
    for rank_results in run_ranks(two_processes, 2, str(tmp_path), timeout=200):
        loads += rank_results.values()
    loads += [load_and_step("local", tmp_path / name) for name in ("pipeline", "zero", "split", "3d")]
    assert len(loads) == 4 * 5 + 2 + 4
    for result in loads:  # a pipeline stage holds its stage's names only
        assert result["global_step"] == 3
        assert result["loaded"] and set(result["loaded"]) <= set(expected)
        for key, value in result["loaded"].items():
            torch.testing.assert_close(value, at_save[key], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(result["after"][key], expected[key], rtol=1e-10, atol=1e-12)
