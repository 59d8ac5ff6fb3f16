"""ZeRO in ``epl plan``'s memory estimate: each rank keeps its chunk of every tensor, as a run does
(epl_memory.zero_estimate)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import epl
from tests.helpers.distributed import run_ranks

LEVELS = ("v0", "v1", "v2")


def uneven() -> nn.Module:
    """Uneven parameter sizes (12x40, 40, 40x7, 7, 7x3, 3): a balanced partition cannot halve them exactly."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 7), nn.Tanh(), nn.Linear(7, 3))


def even(tensors: int) -> nn.Module:
    """``tensors`` weights of 8x8 elements: every partition over a divisor of ``tensors`` is exact."""
    return nn.Sequential(*(nn.Linear(8, 8, bias=False) for _ in range(tensors)))


def estimate(level: str, model: nn.Module, world: int) -> list[tuple[int, int, int | None]]:
    epl.init(epl.Config({"zero.level": level}))
    plan = epl.plan(model, world_size=world, optimizer=lambda p: torch.optim.Adam(p, lr=0.01))
    epl.Env.get().close()
    return [(m.parameter_bytes, m.gradient_bytes, m.optimizer_state_bytes) for m in plan.memory]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("level", LEVELS)
def test_zero_estimate_follows_the_formula(level: str, world: int) -> None:
    """fp32 Adam, Ψ elements, N copies: 4Ψ/N + 4Ψ/N + 8Ψ/N at every level (8-row tensors chunk exactly)."""
    psi, n = 4 * 64, world
    memory = estimate(level, even(4), world)
    assert memory == [(4 * psi // n, 4 * psi // n, 8 * psi // n)] * world
    plain = estimate("", even(4), world)
    assert plain == [(4 * psi, 4 * psi, 8 * psi)] * world


@pytest.mark.parametrize("level", LEVELS)
def test_zero_estimate_of_uneven_tensors_pads_as_fsdp2_does(level: str) -> None:
    """7 rows over 2: 4 and 3; every position's parameter and gradient chunk padded to 4 rows; the optimizer's
    state exactly the rows held, so the states add up to the model's once."""
    model = uneven()
    psi = sum(p.numel() for p in model.parameters())
    padded = sum(-(-p.shape[0] // 2) * (p.numel() // p.shape[0]) for p in model.parameters())
    memory = estimate(level, model, 2)
    assert [m[0] for m in memory] == [4 * padded] * 2 and [m[1] for m in memory] == [4 * padded] * 2
    states = [m[2] for m in memory]
    assert sum(states) == 8 * psi and states[0] > states[1]


def test_zero_leaves_a_local_plan_and_a_pipeline_stage_alone() -> None:
    """One process: nothing to chunk. Two stages on two devices: each tensor has one copy."""
    assert estimate("v2", uneven(), 1) == estimate("", uneven(), 1)
    epl.init(epl.Config({"zero.level": "v1"}))
    with epl.replicate(1):
        first = nn.Linear(4, 8)
    with epl.replicate(1):
        second = nn.Linear(8, 2)
    plan = epl.plan(nn.Sequential(first, second), world_size=2, optimizer=torch.optim.Adam)
    assert [m.gradient_bytes for m in plan.memory] == [4 * 40, 4 * 18]
    assert "ZeRO v1: parameters, gradients and optimizer states chunked evenly" in str(plan)


# -- against memory_report on real processes ---------------------------------------------------


def estimate_then_train(levels: tuple[str, ...]) -> dict[str, Any]:
    """Per level: the estimate of epl.plan, then what memory_report measures after one Adam step."""
    results = {}
    for level in levels:
        env = epl.init(epl.Config({"zero.level": level}))
        factory = lambda params: torch.optim.Adam(params, lr=0.01)  # noqa: E731
        model = uneven()
        plan = epl.plan(model, optimizer=factory)
        engine = epl.parallelize(model, optimizer=factory, loss_fn=nn.MSELoss())
        engine.step(torch.randn(8, 12), torch.randn(8, 3))
        report = engine.memory_report()
        mine = plan.memory[env.cluster.rank]
        results[level] = {
            "estimate": (mine.parameter_bytes, mine.gradient_bytes, mine.optimizer_state_bytes),
            "report": (report.parameter_bytes, report.gradient_bytes, report.optimizer_state_bytes),
        }
        env.close()
    return results


@pytest.mark.multiprocess
def test_zero_estimate_equals_memory_report() -> None:
    """Exact, not within a tolerance: the estimate reproduces FSDP2's chunks, padding included, at every level."""
    results = run_ranks(estimate_then_train, 2, LEVELS, timeout=180)
    for result in results:
        for level in LEVELS:
            assert result[level]["estimate"] == result[level]["report"], level
    assert results[0]["v0"]["estimate"] != results[1]["v0"]["estimate"]  # uneven: the chunks show
