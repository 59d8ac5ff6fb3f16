"""A transformers model trained as it is: dict batches with ``labels`` and no ``loss_fn`` use the model's ``.loss``.

A tiny Llama (random weights, float64, nothing downloaded) takes ``{"input_ids", "labels"}``
batches and returns a ``CausalLMOutputWithPast`` whose ``.loss`` EPL trains on: on 2
processes as 2 data-parallel replicas (each its half of the batch) and as one replica
split over 2 devices, equal to the same model trained in one process with the loop a
transformers user writes (``model(**batch).loss.backward()``). A user's ``loss_fn`` gets the
``ModelOutput`` as the model returned it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import epl
from tests.helpers.distributed import run_ranks
from tests.models.test_transformers_split import BATCH, SEQUENCE, VOCABULARY, llama

pytestmark = pytest.mark.multiprocess

STEPS = 3
#: transformers computes the loss in float32 (``logits.float()``), even for a float64 model: the halves' float32
#: means differ from the whole batch's in the last bits, and so do the gradients that flow back through them.
TOLERANCE = 1e-6


def batches() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(5)
    tokens = [torch.randint(0, VOCABULARY, (BATCH, SEQUENCE), generator=generator) for _ in range(STEPS)]
    return [{"input_ids": t, "labels": t} for t in tokens]


def model() -> nn.Module:
    torch.manual_seed(0)
    return llama().double()


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def train_locally() -> tuple[list[float], dict[str, torch.Tensor]]:
    local = model()
    optimizer = adamw(local.parameters())
    losses = []
    for batch in batches():
        optimizer.zero_grad()
        loss = local(**batch).loss
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, {k: v.clone() for k, v in local.state_dict().items()}


def train(layout: str) -> dict[str, Any]:
    epl.init(epl.Config({}))
    if layout == "split":
        with epl.split(2):
            built = model()
    else:
        built = model()
    engine = epl.parallelize(built, optimizer=adamw)  # no loss_fn: the model's own loss
    share = engine.replica_index * BATCH // engine.num_replicas, BATCH // engine.num_replicas
    losses = []
    for batch in batches():
        mine = {key: value[share[0] : share[0] + share[1]] for key, value in batch.items()}
        losses.append(float(engine.step(mine)))
    state = engine.state_dict(full=True)["model"]
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in state.items()}}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["data parallel", "split"])
def test_the_models_own_loss_trains_as_the_local_run(layout: str) -> None:
    losses, state = train_locally()
    results = run_ranks(train, 2, layout, timeout=280)
    # Each replica's loss is its half's mean; every row has as many labels, so their mean is the batch's.
    replica_mean = [sum(pair) / 2 for pair in zip(*(r["losses"] for r in results), strict=True)]
    torch.testing.assert_close(
        replica_mean if layout != "split" else results[0]["losses"], losses, rtol=TOLERANCE, atol=TOLERANCE
    )
    for result in results:
        for name, value in result["state"].items():
            torch.testing.assert_close(value, state[name], rtol=TOLERANCE, atol=TOLERANCE, msg=name)


def test_a_loss_fn_gets_the_model_output_as_returned() -> None:
    epl.init(epl.Config({}))
    seen: list[str] = []

    def loss_fn(output: Any, labels: torch.Tensor) -> torch.Tensor:
        seen.append(type(output).__name__)
        return nn.functional.cross_entropy(output.logits.flatten(0, 1), labels.flatten())

    engine = epl.parallelize(model(), optimizer=adamw, loss_fn=loss_fn)
    batch = batches()[0]
    engine.step({"input_ids": batch["input_ids"]}, batch["labels"])
    assert seen == ["CausalLMOutputWithPast"]


def test_an_output_without_a_loss_is_one_clear_error() -> None:
    epl.init(epl.Config({}))
    engine = epl.parallelize(model(), optimizer=adamw)
    with pytest.raises(epl.EplError, match="returned a CausalLMOutputWithPast without a loss.*'labels'"):
        engine.step({"input_ids": batches()[0]["input_ids"]})
