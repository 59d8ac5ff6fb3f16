"""Pipeline stages of any strategy and width: ``replicate(k)`` stages, and stages that differ.

A ``replicate(k)`` stage shares each micro-batch out over its k devices (data parallel inside
the stage); a ``split(t)`` stage runs each micro-batch whole on t devices (tensor parallel).
Between two stages that differ, each device takes its rows from the devices that hold them,
and the gradients of its rows back. Each run trains 3 Adam steps of 4 micro-batches with
clipping after the all-reduce, and is compared with the same model trained in one process
(float64, within 1e-10): losses, gradient norms and every parameter.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers.distributed import run_ranks
from tests.helpers.reference import pipeline_rank_result
from tests.pipeline.test_split_stages import adam
from tests.pipeline.test_split_stages import batches as split_stage_batches

pytestmark = pytest.mark.multiprocess

MICRO_BATCHES, REPLICA_ROWS = 4, 16  # 3 steps: the split-stage tests' batches
#: Rows of a last evaluation: 4 micro-batches of 4, the last holding 1 row and 3 of padding.
ODD_ROWS = 13
MAX_NORM = 0.05
TOLERANCE = 1e-10
CONFIG = {
    "pipeline.num_micro_batch": MICRO_BATCHES,
    "pipeline.strategy": "PreferBackward",
    "optimizer.max_grad_norm": MAX_NORM,
    "communication.clip_after_allreduce": True,
}
Stages = tuple[tuple[str, int], tuple[str, int]]


def build(stages: Stages) -> nn.Module:
    """Linear(6, 16) -> GELU -> Linear(16, 8) -> LayerNorm, then Linear(8, 16) -> Tanh -> Linear(16, 4), each half
    in the scope ``stages`` names: ("split", 2), ("replicate", 1), ..."""
    import epl

    torch.manual_seed(0)
    (first_kind, first_count), (second_kind, second_count) = stages
    with getattr(epl, first_kind)(first_count, name="stage_0"):
        first = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 8), nn.LayerNorm(8))
    with getattr(epl, second_kind)(second_count, name="stage_1"):
        second = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    return nn.Sequential(first, second).double()


def batches(replicas: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return split_stage_batches(replicas, REPLICA_ROWS)


def train(stages: Stages, config: dict[str, Any]) -> dict[str, Any]:
    """One rank: train with EPL; its stage, replica, losses, norms, held and whole parameters, and after the last
    step the loss (``Engine.evaluate``) and outputs (``Engine.predict``) of the first batch doubled."""
    import epl

    epl.init(epl.Config({**CONFIG, **config}))
    engine = epl.parallelize(build(stages), optimizer=adam, loss_fn=nn.MSELoss())
    losses, norms = [], []
    data = batches(engine.num_replicas)
    rows = slice(engine.replica_index * REPLICA_ROWS, (engine.replica_index + 1) * REPLICA_ROWS)
    for x, y in data:
        losses.append(float(engine.step(x[rows], y[rows])))
        norms.append(engine.grad_norm)
    x, y = data[0]
    engine.eval()
    evaluated = {"loss": float(engine.evaluate(x[rows] * 2, y[rows])), "output": engine.predict(x[rows] * 2)}
    # ODD_ROWS do not divide into the micro-batches: the last one is padded (a part of a replicate stage's is padding)
    odd = slice(rows.start, rows.start + ODD_ROWS)
    evaluated["odd loss"] = float(engine.evaluate(x[odd] * 2, y[odd]))
    evaluated["odd output"] = engine.predict(x[odd] * 2)
    return pipeline_rank_result(engine, losses, norms, evaluated=evaluated)


def train_locally(stages: Stages, replicas: int, clip: bool = True) -> dict[str, Any]:
    """The one-process reference: every replica's micro-batches, the gradient of the mean loss clipped after the
    replicas' average, one Adam step; then the loss and outputs of the first batch doubled."""
    import epl

    epl.init()
    model = build(stages)
    optimizer = adam(model.parameters())
    losses: list[list[float]] = [[] for _ in range(replicas)]
    norms = []
    data = batches(replicas)
    for x, y in data:
        model.zero_grad()
        for replica, (xs, ys) in enumerate(zip(x.chunk(replicas), y.chunk(replicas), strict=True)):
            parts = []
            for xm, ym in zip(xs.chunk(MICRO_BATCHES), ys.chunk(MICRO_BATCHES), strict=True):
                loss = nn.functional.mse_loss(model(xm), ym)
                (loss / MICRO_BATCHES / replicas).backward()
                parts.append(float(loss.detach()))
            losses[replica].append(sum(parts) / MICRO_BATCHES)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)) if clip else None)
        optimizer.step()
    x, y = data[0]
    with torch.no_grad():
        outputs = [model(xs * 2) for xs in x.chunk(replicas)]
        evaluated = [float(nn.functional.mse_loss(o, ys)) for o, ys in zip(outputs, y.chunk(replicas), strict=True)]
        odd = [
            float(nn.functional.mse_loss(o[:ODD_ROWS], ys[:ODD_ROWS]))
            for o, ys in zip(outputs, y.chunk(replicas), strict=True)
        ]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "norms": norms, "state": state, "outputs": outputs, "evaluated": evaluated, "odd": odd}


def assert_equal_to_local(
    results: list[dict[str, Any]], stages: Stages, held: dict[int, int], clip: bool = True
) -> None:
    replicas = 1 + max(r["replica"] for r in results)
    local = train_locally(stages, replicas, clip)
    assert not clip or local["norms"][0] > MAX_NORM  # clipping acts
    for result in results:
        replica, stage = result["replica"], result["stage"]
        assert result["held"] == held[stage]
        close = {"rtol": TOLERANCE, "atol": TOLERANCE}
        torch.testing.assert_close(result["losses"], local["losses"][replica], **close)
        torch.testing.assert_close(result["norms"], local["norms"], **close)
        assert result["evaluated"]["loss"] == pytest.approx(local["evaluated"][replica], rel=TOLERANCE)
        assert result["evaluated"]["odd loss"] == pytest.approx(local["odd"][replica], rel=TOLERANCE)
        if stage == 1:  # every device of the last stage returns the replica's whole outputs
            torch.testing.assert_close(result["evaluated"]["output"], local["outputs"][replica], **close)
            expected = local["outputs"][replica][:ODD_ROWS]
            torch.testing.assert_close(result["evaluated"]["odd output"], expected, **close)
        else:
            assert result["evaluated"]["output"] is None and result["evaluated"]["odd output"] is None
        for name, value in result["state"].items():
            torch.testing.assert_close(value, local["state"][name], msg=name, **close)
    assert {name for r in results for name in r["state"]} == set(local["state"])


#: Parameters of each half whole, and of a device of a split(2) half (half of each Linear, the rest whole).
WHOLE = {0: 6 * 16 + 16 + 16 * 8 + 8 + 8 + 8, 1: 8 * 16 + 16 + 16 * 4 + 4}
SPLIT_2 = {0: 8 * 6 + 8 + 8 * 8 + 8 + 8 + 8, 1: 8 * 8 + 8 + 4 * 8 + 4}


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("stages", "processes", "held"),
    [
        ((("replicate", 2), ("replicate", 2)), 4, WHOLE),
        ((("split", 2), ("replicate", 2)), 4, {0: SPLIT_2[0], 1: WHOLE[1]}),
        ((("replicate", 2), ("split", 2)), 4, {0: WHOLE[0], 1: SPLIT_2[1]}),
        ((("replicate", 1), ("split", 2)), 3, {0: WHOLE[0], 1: SPLIT_2[1]}),
        ((("replicate", 2), ("replicate", 1)), 6, WHOLE),
    ],
    ids=["replicate2-replicate2", "split2-replicate2", "replicate2-split2", "replicate1-split2", "2x-replicate2-1"],
)
def test_stages_of_any_strategy_and_width_equal_the_local_run(stages: Stages, processes: int, held: dict) -> None:
    results = run_ranks(train, processes, stages, {}, timeout=140)
    widths = [count for _, count in stages]
    per_replica = [0] * widths[0] + [1] * widths[1]
    assert [r["stage"] for r in results] == per_replica * (processes // sum(widths))
    assert_equal_to_local(results, stages, held)


@pytest.mark.timeout(150)
def test_replicate_stages_with_zero_v1_and_gpipe_equal_the_local_run() -> None:
    """ZeRO v1 shards each stage's optimizer state over its copies (the stage's 2 devices); no clipping (ZeRO v1
    clips before the all-reduce, which stages that share micro-batches out cannot)."""
    stages = (("replicate", 2), ("replicate", 2))
    config = {"zero.level": "v1", "pipeline.strategy": "PreferForward", "optimizer.max_grad_norm": None}
    results = run_ranks(train, 4, stages, config, timeout=140)
    assert_equal_to_local(results, stages, WHOLE, clip=False)


def clipping_before_the_reduction() -> str:
    import epl

    epl.init(epl.Config({**CONFIG, "communication.clip_after_allreduce": False}))
    try:
        epl.parallelize(build((("replicate", 2), ("replicate", 1))), optimizer=adam, loss_fn=nn.MSELoss())
    except epl.ConfigError as error:
        return str(error)
    return "no error"


def rows_that_do_not_share_out() -> str:
    import epl

    epl.init(epl.Config(CONFIG))
    engine = epl.parallelize(build((("replicate", 2), ("replicate", 1))), optimizer=adam, loss_fn=nn.MSELoss())
    try:  # 12 rows: 4 micro-batches of 3, which the replicate(2) stage cannot share out
        engine.step(torch.zeros(12, 6, dtype=torch.float64), torch.zeros(12, 4, dtype=torch.float64))
    except epl.BatchError as error:
        return str(error)
    return "no error"


@pytest.mark.timeout(90)
def test_replicate_stages_refuse_clipping_before_the_reduction_and_batches_that_do_not_share_out() -> None:
    for message in run_ranks(clipping_before_the_reduction, 3, timeout=80):
        assert "'stage_0' is replicate(2)" in message and "communication.clip_after_allreduce=True" in message
    for message in run_ranks(rows_that_do_not_share_out, 3, timeout=80):
        assert "engine.step got a batch of 12 rows" in message and "replicate stages" in message
        assert "multiples of 8" in message


def test_each_row_moves_from_one_holder_spread_by_position() -> None:
    """split(2) (whole micro-batches on 2 devices) into replicate(4) (a quarter each): each receiver takes its rows
    from sender (position mod 2); each sender takes the gradients of every row back, a quarter from each receiver."""
    from fractions import Fraction

    from epl_pipeline.resharding import StageShape, Transfer, backward_transfers, forward_transfers

    split, shared = StageShape(width=2, parts=1), StageShape(width=4, parts=4)
    quarter = [(Fraction(q, 4), Fraction(q + 1, 4)) for q in range(4)]
    assert forward_transfers(split, shared) == [Transfer(q % 2, q, *quarter[q]) for q in range(4)]
    assert backward_transfers(split, shared) == [Transfer(q, p, *quarter[q]) for p in range(2) for q in range(4)]
    # replicate(2) into replicate(1): the one receiver joins both halves; each sender's gradients come from it
    halves = [(Fraction(0), Fraction(1, 2)), (Fraction(1, 2), Fraction(1))]
    two, one = StageShape(2, 2), StageShape(1, 1)
    assert forward_transfers(two, one) == [Transfer(0, 0, *halves[0]), Transfer(1, 0, *halves[1])]
    assert backward_transfers(two, one) == [Transfer(0, 0, *halves[0]), Transfer(0, 1, *halves[1])]
