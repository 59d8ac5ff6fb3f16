"""Tensor parallelism inside pipeline stages, data parallelism over them: ``split(2)`` stages in a row.

Two ``epl.split(2)`` TaskGraphs in a row are a 2-stage pipeline on 4 processes, each
stage tensor parallel over its 2 devices (its Linear pair column- then row-parallel);
on 8 processes there are 2 replicas of that, also with ZeRO v1 over the replicas. Each
run trains 3 Adam steps of 4
micro-batches with clipping on and is compared with the same model trained in one
process (float64, within 1e-10): losses, the gradient norm of every step, and every
parameter (each stage's gathered whole by its devices). Each device holds only its
stage's shards.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers.distributed import run_ranks
from tests.helpers.reference import pipeline_rank_result

pytestmark = pytest.mark.multiprocess

STEPS, MICRO_BATCHES, REPLICA_ROWS = 3, 4, 8
MAX_NORM = 0.05
TOLERANCE = 1e-10
#: What each device of a stage holds: half of the column layer's rows and bias, half of the row layer's
#: columns, and the row layer's bias and the LayerNorm whole.
STAGE_PARAMETERS = {0: 8 * 6 + 8 + 8 * 8 + 8 + 8 + 8, 1: 8 * 8 + 8 + 4 * 8 + 4}


def build() -> nn.Module:
    """Two split(2) stages: Linear(6, 16) -> GELU -> Linear(16, 8) -> LayerNorm, then Linear(8, 16) -> Tanh ->
    Linear(16, 4)."""
    import epl

    torch.manual_seed(0)
    with epl.split(2, name="stage_0"):
        first = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 8), nn.LayerNorm(8))
    with epl.split(2, name="stage_1"):
        second = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    return nn.Sequential(first, second).double()


def one_split_scope() -> nn.Module:
    """The same layers built in one ``epl.split(2)`` scope, for ``auto.auto_parallel`` to cut into stages."""
    import epl

    torch.manual_seed(0)
    with epl.split(2, name="everything"):
        first = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 8), nn.LayerNorm(8))
        second = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    return nn.Sequential(first, second).double()


BUILDERS = {"stages": build, "auto": one_split_scope}


def batches(replicas: int, replica_rows: int = REPLICA_ROWS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``STEPS`` batches of ``replicas`` x ``replica_rows`` rows (inputs of 6, targets of 4 features)."""
    generator = torch.Generator().manual_seed(2)
    rows = replicas * replica_rows
    return [
        (
            torch.randn(rows, 6, generator=generator, dtype=torch.float64),
            torch.randn(rows, 4, generator=generator, dtype=torch.float64),
        )
        for _ in range(STEPS)
    ]


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def train(config: dict[str, Any], evaluate: bool = False, model: str = "stages") -> dict[str, Any]:
    """One rank: train the split stages with EPL; its stage, replica, losses, norms, held and whole parameters.

    ``evaluate``: after the first step, also the loss (``Engine.evaluate``) and the outputs (``Engine.predict``)
    of the first batch doubled.
    """
    import epl

    epl.init(epl.Config({"pipeline.num_micro_batch": MICRO_BATCHES, "optimizer.max_grad_norm": MAX_NORM, **config}))
    engine = epl.parallelize(BUILDERS[model](), optimizer=adam, loss_fn=nn.MSELoss())
    losses, norms, evaluated = [], [], {}
    for step, (x, y) in enumerate(batches(engine.num_replicas)):
        rows = slice(engine.replica_index * REPLICA_ROWS, (engine.replica_index + 1) * REPLICA_ROWS)
        losses.append(float(engine.step(x[rows], y[rows])))
        norms.append(engine.grad_norm)
        if step == 0 and evaluate:  # a validation pass between steps: forward only, nothing trained
            engine.eval()
            evaluated = {"loss": float(engine.evaluate(x[rows] * 2, y[rows])), "output": engine.predict(x[rows] * 2)}
            engine.train()
    from epl_memory.checkpointing import CheckpointingState

    checkpointed = engine.context.state(CheckpointingState).plan
    return pipeline_rank_result(
        engine,
        losses,
        norms,
        checkpointed=checkpointed.describe() if checkpointed is not None else None,
        evaluated=evaluated,
        repr=repr(engine.model),
    )


def train_locally(
    replicas: int, *, after_average: bool = False
) -> tuple[list[list[float]], list[list[float]], dict[str, torch.Tensor]]:
    """The one-process reference: each replica's rows in micro-batches, its gradient clipped on its own (clipping
    before the all-reduce, the default), the replicas' gradients averaged, one Adam step; ``after_average``: the
    average clipped by its own norm instead (ZeRO reduces inside the backward)."""
    import epl

    epl.init()
    model = build()
    optimizer = adam(model.parameters())
    losses: list[list[float]] = [[] for _ in range(replicas)]
    norms: list[list[float]] = [[] for _ in range(replicas)]
    for x, y in batches(replicas):
        total = [torch.zeros_like(p) for p in model.parameters()]
        for replica, (xs, ys) in enumerate(zip(x.chunk(replicas), y.chunk(replicas), strict=True)):
            model.zero_grad()
            parts = []
            for xm, ym in zip(xs.chunk(MICRO_BATCHES), ys.chunk(MICRO_BATCHES), strict=True):
                loss = nn.functional.mse_loss(model(xm), ym)
                (loss / MICRO_BATCHES).backward()
                parts.append(float(loss.detach()))
            if not after_average:
                norms[replica].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
            losses[replica].append(sum(parts) / MICRO_BATCHES)
            for sum_, p in zip(total, model.parameters(), strict=True):
                sum_ += p.grad / replicas
        for p, grad in zip(model.parameters(), total, strict=True):
            p.grad = grad
        if after_average:
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
            for replica in range(replicas):
                norms[replica].append(norm)
        optimizer.step()
    return losses, norms, {k: v.clone() for k, v in model.state_dict().items()}


def assert_equal_to_local(
    results: list[dict[str, Any]], replicas: int, held: dict[int, int] = STAGE_PARAMETERS, *, zero: bool = False
) -> None:
    """Each rank equal to one process, holding its stage's tensors (under ZeRO, its chunks of them)."""
    losses, norms, state = train_locally(replicas, after_average=zero)
    if zero:  # every row count here is even: each of the 2 replicas holds half
        held = {stage: count // replicas for stage, count in held.items()}
    assert norms[0][0] > MAX_NORM  # clipping acts
    for result in results:
        replica = result["replica"]
        assert result["held"] == held[result["stage"]]
        torch.testing.assert_close(result["losses"], losses[replica], rtol=TOLERANCE, atol=TOLERANCE)
        torch.testing.assert_close(result["norms"], norms[replica], rtol=TOLERANCE, atol=TOLERANCE)
        for name, value in result["state"].items():
            torch.testing.assert_close(value, state[name], rtol=TOLERANCE, atol=TOLERANCE, msg=name)
    # Each stage's devices hold (and gather whole) their stage's tensors, the stages together all of them.
    for stage in (0, 1):
        names = [set(r["state"]) for r in results if r["stage"] == stage]
        assert all(n == names[0] for n in names)
    assert {name for r in results for name in r["state"]} == set(state)
    assert not set.intersection(*({*r["state"]} for r in results))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "config",
    [
        {"pipeline.strategy": "PreferForward"},
        {"pipeline.strategy": "PreferBackward"},
        {"pipeline.strategy": "PreferBackward", "gradient_checkpoint.type": "auto"},
    ],
)
def test_two_split_stages_on_four_processes_equal_the_local_run(config: dict[str, Any]) -> None:
    results = run_ranks(train, 4, config, timeout=100)
    if "gradient_checkpoint.type" in config:  # each stage recomputes segments of its own Sequential
        assert [r["checkpointed"] for r in results] == ["0: 2 segments"] * 2 + ["1: 2 segments"] * 2
    assert [(r["stage"], r["replica"]) for r in results] == [(0, 0), (0, 0), (1, 0), (1, 0)]
    assert "(0): ColumnParallelLinear" in results[0]["repr"] and "(2): RowParallelLinear" in results[0]["repr"]
    assert "stage=1 (on another rank)" in results[0]["repr"] and "stage=0 (on another rank)" in results[2]["repr"]
    assert_equal_to_local(results, 1)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("zero", [None, "v1"])
def test_split_stages_times_two_replicas_on_eight_processes_equal_the_local_run(zero: str | None) -> None:
    """TP 2 x PP 2 x DP 2 (with ZeRO v1 over the replicas: each shard chunked over them, the average clipped): the
    4 devices of a replica are consecutive, the stage's 2 devices too."""
    results = run_ranks(train, 8, {"zero.level": zero} if zero else {}, timeout=220)
    assert [(r["stage"], r["replica"]) for r in results] == [(0, 0), (0, 0), (1, 0), (1, 0)] + [
        (0, 1),
        (0, 1),
        (1, 1),
        (1, 1),
    ]
    assert_equal_to_local(results, 2, zero=zero is not None)


@pytest.mark.timeout(120)
def test_evaluation_between_steps_runs_forward_only_and_trains_nothing() -> None:
    """``engine.evaluate`` and ``engine.predict`` on 2 split stages after the first step: the local model's loss and
    outputs at that point; the training run after them is unchanged (equal to the local run)."""
    results = run_ranks(train, 4, {}, True, timeout=100)
    import epl

    epl.init()
    model = build()
    optimizer = adam(model.parameters())
    (x, y), *_ = batches(1)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    optimizer.step()
    with torch.no_grad():
        expected_output = model(x * 2)
        expected_loss = float(nn.functional.mse_loss(expected_output, y))
    for result in results:
        assert result["evaluated"]["loss"] == pytest.approx(expected_loss, rel=TOLERANCE, abs=TOLERANCE)
        if result["stage"] == 1:  # the last stage's ranks hold the outputs, the others None
            torch.testing.assert_close(result["evaluated"]["output"], expected_output, rtol=TOLERANCE, atol=TOLERANCE)
        else:
            assert result["evaluated"]["output"] is None
    assert_equal_to_local(results, 1)


@pytest.mark.timeout(120)
def test_auto_parallel_cuts_a_split_model_into_split_stages() -> None:
    """``with epl.split(2)`` around the whole model, ``auto.auto_parallel`` with 2 stages on 4 processes: each
    stage tensor parallel over 2 devices, equal to the local run."""
    config = {"auto.auto_parallel": True, "pipeline.num_stages": 2}
    results = run_ranks(train, 4, config, False, "auto", timeout=100)
    assert [(r["stage"], r["replica"]) for r in results] == [(0, 0), (0, 0), (1, 0), (1, 0)]
    assert "(0): ColumnParallelLinear" in results[0]["repr"] and "(2): RowParallelLinear" in results[2]["repr"]
    # Cut by parameter counts: the LayerNorm goes with the second stage (248 + 228 rather than 264 + 212).
    assert_equal_to_local(results, 1, held={0: 8 * 6 + 8 + 8 * 8 + 8, 1: 8 + 8 + 8 * 8 + 8 + 4 * 8 + 4})
