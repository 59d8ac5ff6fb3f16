"""Interleaved 1F1B: several stages per rank (``pipeline.stages_per_rank``, Megatron's virtual pipeline).

The manual's eight-layer by-hand model has four stages; with ``stages_per_rank=2`` they run on
two ranks (stages 0 and 2 on the first, 1 and 3 on the second), by ``Interleaved1F1B``. Every
run is compared with the model trained in one process (same seed, same batches, float64):
losses and every parameter within 1e-12, clipping on.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers.distributed import run_ranks
from tests.helpers.reference import assert_rank_matches, train_locally
from tests.pipeline.test_pipeline import MICRO, REPLICA_BATCH, STEPS, batches  # the same batches as 1F1B's tests

pytestmark = pytest.mark.multiprocess

MAX_NORM = 0.5
TOLERANCE = 1e-12


def build() -> nn.Module:
    from epl.examples.manual import by_hand

    torch.manual_seed(0)
    return by_hand().double()


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


def train(extra: dict[str, Any]) -> dict[str, Any]:
    """One rank: 3 steps of the four-stage model, two stages per rank; then an evaluation and a prediction."""
    import epl

    settings = {
        "pipeline.num_micro_batch": MICRO,
        "pipeline.stages_per_rank": 2,
        "pipeline.strategy": "Interleaved1F1B",
        "optimizer.max_grad_norm": MAX_NORM,
        **extra,
    }
    epl.init(epl.Config(settings))
    engine = epl.parallelize(build(), optimizer=adam, loss_fn=nn.MSELoss())
    share = slice(engine.replica_index * REPLICA_BATCH, (engine.replica_index + 1) * REPLICA_BATCH)
    losses, norms = [], []
    for x, y in batches(engine.num_replicas):
        losses.append(float(engine.step(x[share], y[share])))
        norms.append(engine.grad_norm)
    runner = engine.context.step_runner
    x, y = batches(engine.num_replicas)[0]
    prediction = engine.predict(x[share])
    return {
        "stages": engine.context.pipeline.stages,
        "replica": engine.replica_index,
        "losses": losses,
        "norms": norms,
        "actions": [str(event.action) for event in runner.last_timeline],
        "peak_in_flight": runner.peak_in_flight,
        "evaluated": float(engine.evaluate(x[share], y[share])),
        "prediction": None if prediction is None else prediction.clone(),
        "state": engine.state_dict(full=True)["model"],
    }


def reference(
    replicas: int, max_norm: float | None = MAX_NORM
) -> tuple[list[float], dict[str, torch.Tensor], nn.Module]:
    import epl

    epl.init()
    model = build()
    optimizer = adam(model.parameters())
    losses, state = train_locally(model, optimizer, batches(replicas), MICRO * replicas, max_norm=max_norm)
    return losses, state, model


def test_four_stages_on_two_ranks_interleaved_equal_the_local_run() -> None:
    ranks = run_ranks(train, 2, {}, timeout=180)
    losses, full, model = reference(1)
    assert [r["stages"] for r in ranks] == [(0, 2), (1, 3)]
    for result in ranks:
        assert_rank_matches(result, losses, full, TOLERANCE)
        assert len(result["state"]) == 8  # two stages of two Linear layers each
        assert len(set(result["norms"])) == STEPS and all(norm > 0 for norm in result["norms"])
    assert sorted(k for r in ranks for k in r["state"]) == sorted(full)
    assert ranks[0]["norms"] == ranks[1]["norms"]  # one norm over both ranks' stages
    # Megatron's order on rank 0 (P=2, v=2, m=4): warm-up 0F0 0F1 2F0 2F1 0F2 ..., both chunks each micro-batch
    assert ranks[0]["actions"][:5] == ["0F0", "0F1", "2F0", "2F1", "0F2"]
    assert sorted(ranks[1]["actions"]) == sorted(f"{s}{k}{m}" for s in (1, 3) for k in "FB" for m in range(MICRO))
    assert ranks[0]["peak_in_flight"] > 2  # interleaving holds more micro-batch chunks than 1F1B's 2
    x, y = batches(1)[0]
    with torch.no_grad():
        output = model(x)
    torch.testing.assert_close(ranks[1]["prediction"], output, rtol=TOLERANCE, atol=TOLERANCE)
    assert ranks[0]["prediction"] is None
    for result in ranks:
        expected = float(nn.functional.mse_loss(output, y))
        assert result["evaluated"] == pytest.approx(expected, rel=1e-12)


def test_interleaved_stages_with_two_replicas_and_zero_v1_equal_the_local_run() -> None:
    """4 processes: 2 replicas of two ranks, each running two stages; ZeRO v1 chunks each stage over the replicas."""
    ranks = run_ranks(train, 4, {"zero.level": "v1", "optimizer.max_grad_norm": None}, timeout=240)
    losses, full, _ = reference(2, max_norm=None)
    assert sorted(r["replica"] for r in ranks) == [0, 0, 1, 1]
    mean = torch.tensor([r["losses"] for r in ranks if 3 in r["stages"]], dtype=torch.float64).mean(0).tolist()
    torch.testing.assert_close(mean, losses, rtol=TOLERANCE, atol=TOLERANCE)
    for result in ranks:
        for name, value in result["state"].items():
            torch.testing.assert_close(value, full[name], rtol=TOLERANCE, atol=TOLERANCE, msg=name)
