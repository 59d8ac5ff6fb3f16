"""A pipeline evaluates and predicts batches of any size, whatever size the last call used.

A batch that divides into ``pipeline.num_micro_batch`` micro-batches is cut evenly; one that
does not has its last micro-batch padded (repeated rows; a dict's integer ``labels`` -100),
the padding cut from the outputs and kept out of the loss. On 2 processes (2 stages, 2
micro-batches), each result equals one process computing it on the whole batch (float64):

- the manual's two-stage model after a training step: ``evaluate`` (``loss_fn``) and
  ``predict`` on 16, 4, 6, 5 and 1 rows in a row; training steps of 4 and then 8 rows (sizes
  may change between steps); a step of 5 rows is one clear error on every rank, naming the
  batch size, the micro-batch count and the fix; a stage whose output changes between the
  micro-batches of one batch is still refused;
- an unmodified transformers Llama (tiny, random weights) cut automatically into 2 stages: its
  own ``.loss`` with ``labels`` on 4, 6, 5 and 1 rows of 8 tokens and 3 rows of 5, and ``predict``'s logits.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers.distributed import run_ranks
from tests.models.test_transformers_pipeline import llama as transformers_llama
from tests.pipeline.test_pipeline import build

for _name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
    os.environ.setdefault(_name, "1")  # nothing downloaded: tiny configs, random weights

pytestmark = pytest.mark.multiprocess

MICRO = 2
#: Evaluated and predicted in this order: 5 does not divide into 2 micro-batches, 1 is fewer rows than micro-batches.
SIZES = (16, 4, 6, 5, 1)
#: Training steps after the evaluations: the size may change between steps when it divides.
STEP_SIZES = (4, 8)
#: The Llama's batches: (rows, sequence length); the last is shorter, as a last batch of another length is.
LLAMA_SIZES = ((4, 8), (6, 8), (5, 8), (1, 8), (3, 5))
VOCABULARY, SEQUENCE = 64, 8
TOLERANCE = 1e-12
#: transformers computes its own loss in float32 (``logits.float()``), even for a float64 model.
OWN_LOSS_TOLERANCE = 1e-6


def data(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(rows, 12, generator=generator, dtype=torch.float64),
        torch.randn(rows, 12, generator=generator, dtype=torch.float64),
    )


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


class Ragged(nn.Module):
    """A stage whose output loses a column on every other call: micro-batches of one batch differ."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.linear(x)[:, : 4 - self.calls % 2]


class Scale(nn.Module):
    """A stage that takes any number of columns."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def llama() -> nn.Module:
    """The 4-layer Llama of the transformers pipeline tests, seeded, in float64."""
    torch.manual_seed(0)
    return transformers_llama().double()


def tokens(rows: int, length: int) -> torch.Tensor:
    return torch.randint(0, VOCABULARY, (rows, length), generator=torch.Generator().manual_seed(rows))


def on_each_rank() -> dict[str, Any]:
    """One rank: the two-stage model's evaluations, predictions and steps, the Llama's, then a ragged stage (last:
    it leaves a receive unanswered)."""
    import epl

    epl.init(epl.Config({"pipeline.num_micro_batch": MICRO}))
    engine = epl.parallelize(build(), optimizer=adam, loss_fn=nn.MSELoss())
    engine.step(*data(8, 0))
    evaluated, predicted = [], []
    for size in SIZES:
        x, y = data(size, size)
        evaluated.append(float(engine.evaluate(x, y)))
        output = engine.predict(x)
        predicted.append(None if output is None else output.clone())
    steps = [float(engine.step(*data(size, 100 + size))) for size in STEP_SIZES]
    with pytest.raises(epl.BatchError) as refused:
        engine.step(*data(5, 5))
    after = float(engine.evaluate(*data(5, 5)))  # the refused step left nothing half-sent
    state = {k: v.detach().clone() for k, v in engine.state_dict(full=True)["model"].items()}

    epl.init(epl.Config({"pipeline.num_micro_batch": MICRO, "auto.auto_parallel": True, "pipeline.num_stages": 2}))
    model = epl.parallelize(llama())  # no loss_fn: the model's own loss from the batch's labels
    own_losses, logits = [], []
    for size in LLAMA_SIZES:
        ids = tokens(*size)
        own_losses.append(float(model.evaluate({"input_ids": ids, "labels": ids})))
        output = model.predict({"input_ids": ids})
        logits.append(None if output is None else output.logits.clone())

    epl.init(epl.Config({"pipeline.num_micro_batch": MICRO, "communication.timeout": 5}))
    with epl.replicate(device_count=1, name="stage_0"):
        first = Ragged()
    with epl.replicate(device_count=1, name="stage_1"):
        second = Scale()
    ragged = epl.parallelize(nn.Sequential(first, second).double(), loss_fn=nn.MSELoss())
    try:
        ragged.predict(torch.ones(4, 4, dtype=torch.float64))
        ragged_error = ""
    except Exception as error:  # stage 0 names the change; stage 1, left waiting, sees it go (or times out)
        ragged_error = f"{type(error).__name__}: {error}"
    return {
        "evaluated": evaluated,
        "predicted": predicted,
        "steps": steps,
        "refused": str(refused.value),
        "after": after,
        "state": state,
        "ragged": ragged_error,
        "own_losses": own_losses,
        "logits": logits,
    }


def in_one_process() -> dict[str, Any]:
    """The same calls on the whole model in one process: each loss over the whole batch."""
    import epl

    epl.init(epl.Config({}))  # the annotations of build() need it; the model runs as it is
    model = build()
    optimizer = adam(model.parameters())

    def train(x: torch.Tensor, y: torch.Tensor) -> float:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    train(*data(8, 0))
    evaluated, predicted = [], []
    with torch.no_grad():
        for size in SIZES:
            x, y = data(size, size)
            evaluated.append(float(nn.functional.mse_loss(model(x), y)))
            predicted.append(model(x))
    steps = [train(*data(size, 100 + size)) for size in STEP_SIZES]
    with torch.no_grad():
        x, y = data(5, 5)
        after = float(nn.functional.mse_loss(model(x), y))
        language = llama()
        own_losses = [float(language(input_ids=tokens(*s), labels=tokens(*s)).loss) for s in LLAMA_SIZES]
        logits = [language(input_ids=tokens(*s)).logits for s in LLAMA_SIZES]
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {
        "evaluated": evaluated,
        "predicted": predicted,
        "steps": steps,
        "after": after,
        "state": state,
        "own_losses": own_losses,
        "logits": logits,
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(on_each_rank, 2, timeout=240)


@pytest.fixture(scope="module")
def local() -> dict[str, Any]:
    return in_one_process()


def test_evaluate_takes_any_batch_size_as_one_process(ranks: list[dict[str, Any]], local: dict[str, Any]) -> None:
    for result in ranks:
        assert result["evaluated"] == pytest.approx(local["evaluated"], rel=TOLERANCE, abs=TOLERANCE)
        assert result["after"] == pytest.approx(local["after"], rel=TOLERANCE)


def test_predict_takes_any_batch_size_without_the_padding(ranks: list[dict[str, Any]], local: dict[str, Any]) -> None:
    assert all(output is None for output in ranks[0]["predicted"])  # the first stage returns nothing
    for output, expected, size in zip(ranks[1]["predicted"], local["predicted"], SIZES, strict=True):
        assert output.shape == (size, 12)
        torch.testing.assert_close(output, expected, rtol=TOLERANCE, atol=TOLERANCE)


def test_training_steps_may_change_size_and_a_size_that_does_not_divide_is_named(
    ranks: list[dict[str, Any]], local: dict[str, Any]
) -> None:
    for result in ranks:
        assert result["steps"] == pytest.approx(local["steps"], rel=TOLERANCE)
        for name, value in result["state"].items():
            torch.testing.assert_close(value, local["state"][name], rtol=TOLERANCE, atol=TOLERANCE)
        message = result["refused"]
        assert "engine.step got a batch of 5 rows" in message
        assert "pipeline.num_micro_batch=2" in message and "multiples of 2" in message and "drop_last" in message
        assert "ShapeOnly" not in message


def test_a_change_between_micro_batches_of_one_batch_is_still_refused(ranks: list[dict[str, Any]]) -> None:
    message = ranks[0]["ragged"]
    assert "changed between micro-batches of one batch" in message
    assert "float64[2, 3]" in message and "float64[2, 4]" in message
    assert "ShapeOnly" not in message
    assert ranks[1]["ragged"]  # the stage waiting for it is not left hanging past the timeout


def test_a_transformers_pipeline_evaluates_and_predicts_any_batch_size(
    ranks: list[dict[str, Any]], local: dict[str, Any]
) -> None:
    for result in ranks:
        assert result["own_losses"] == pytest.approx(local["own_losses"], rel=OWN_LOSS_TOLERANCE)
    assert all(logits is None for logits in ranks[0]["logits"])
    for logits, expected in zip(ranks[1]["logits"], local["logits"], strict=True):
        torch.testing.assert_close(logits, expected, rtol=TOLERANCE, atol=TOLERANCE)


def test_batches_are_cut_into_equal_micro_batches_and_the_last_padded() -> None:
    """The cut alone: sizes, padding rows (the last row repeated, a dict's integer labels -100), and refusals."""
    import epl
    from epl_pipeline.padding import cut, first_rows

    rows = torch.arange(5.0).unsqueeze(1)
    five = cut(rows, rows * 2, 2, 1, call="engine.evaluate", own_loss=False)
    assert (five.rows, five.real, five.total) == (3, [3, 2], 5)
    assert five.pieces[1][0].flatten().tolist() == [3.0, 4.0, 4.0]
    assert five.pieces[1][1].flatten().tolist() == [6.0, 8.0, 8.0]
    assert first_rows({"out": five.pieces[1][0], "scale": torch.tensor(2.0)}, 3, 2)[0]["out"].flatten().tolist() == [
        3.0,
        4.0,
    ]
    # replicate stages in 2 parts: micro-batches of a multiple of 2 rows; 1 row on 2 micro-batches runs one
    assert cut(rows, None, 2, 2, call="engine.predict", own_loss=False).real == [4, 1]
    assert cut(rows[:1], None, 2, 1, call="engine.predict", own_loss=False).real == [1]
    six = cut(torch.zeros(6, 1), None, 4, 1, call="engine.predict", own_loss=False)
    assert (six.rows, six.real) == (2, [2, 2, 2])  # divides into 3 micro-batches of 2: no padding
    ids = torch.arange(10).view(5, 2)
    labelled = cut({"input_ids": ids, "labels": ids}, None, 2, 1, call="engine.evaluate", own_loss=True)
    assert labelled.pieces[1][0]["labels"][-1].tolist() == [-100, -100]
    assert labelled.pieces[1][0]["input_ids"][-1].tolist() == [8, 9]
    with pytest.raises(epl.BatchError, match=r"engine.evaluate got a batch of 5 rows.*num_micro_batch=2.*loss_fn"):
        cut({"input_ids": ids}, None, 2, 1, call="engine.evaluate", own_loss=True)
    with pytest.raises(epl.BatchError, match=r"engine.predict got an empty batch"):
        cut(torch.zeros(0, 3), None, 2, 1, call="engine.predict", own_loss=False)
