"""``context.degree 2`` composed with the other parallelisms on 4 processes, on transformers' Llama (grouped-query
attention) in float64, against one process: the losses and every parameter after 3 AdamW steps within 1e-10.

Each replica is 2 lanes, each laid out as the annotations say: ``split(2)`` (each context device holds a tensor
shard, its ring carrying its own heads' keys and values), ``split(2)`` with sequence parallelism, a 2-stage
pipeline (every stage's attention reads the tokens' facts), ``replicate(2)`` (each lane's devices share the batch
out; every half of a batch has as many labelled tokens, so the mean of the halves' losses is the batch's), and
``split(2)`` x 2 stages on 8 processes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.context.test_context_training import TOLERANCE, adamw, batches, llama, locally, next_token_loss
from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.multiprocess

PIPELINE = {"pipeline.num_stages": 2, "auto.auto_parallel": True, "pipeline.num_micro_batch": 2}
LAYOUTS: dict[str, tuple[str | None, dict[str, Any], list[str]]] = {
    "split(2)": ("split", {}, ["causal", "right-padded", "packed documents"]),
    "split(2), sequence parallel": ("split", {"split.sequence_parallel": True}, ["packed documents"]),
    "2 stages": (None, PIPELINE, ["causal", "packed documents"]),
    "replicate(2)": ("replicate", {}, ["packed documents"]),
    "split(2) x 2 stages": ("split", PIPELINE, ["packed documents"]),
}
#: Processes each layout runs on: 2 lanes of its devices.
WORLD = {"split(2) x 2 stages": 8}


def train(name: str) -> dict[str, dict[str, Any]]:
    """Every batch kind of layout ``name`` on this rank: its losses, the model gathered whole, what the plan says."""
    import epl

    annotation, config, kinds = LAYOUTS[name]
    results = {}
    for kind in kinds:
        epl.init(epl.Config({"context.degree": 2, **config}))
        if annotation == "split":
            with epl.split(2):
                model = llama()
        elif annotation == "replicate":
            with epl.replicate(2):
                model = llama()
        else:
            model = llama()
        engine = epl.parallelize(model, optimizer=adamw, loss_fn=next_token_loss)
        losses = [
            float(engine.step({k: v for k, v in batch.items() if k != "targets"}, batch["targets"]))
            for batch in batches(kind)
        ]
        results[kind] = {
            "losses": losses,
            "state": engine.state_dict(full=True)["model"],
            "replicas": engine.num_replicas,
            "groups": engine.plan.process_groups(),
        }
    return results


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallelism_composes_with_split_pipelines_and_replicate(name: str) -> None:
    world = WORLD.get(name, 4)
    results = run_ranks(train, world, name, timeout=540)
    for kind in LAYOUTS[name][2]:
        losses, state = locally(kind)
        for rank, result in enumerate(results):
            found = result[kind]
            assert found["replicas"] == 1
            assert found["groups"]["context parallel"] == [(i, i + world // 2) for i in range(world // 2)]
            torch.testing.assert_close(found["losses"], losses, rtol=TOLERANCE, atol=TOLERANCE, msg=f"{kind}, {rank}")
            for key, value in found["state"].items():
                torch.testing.assert_close(value, state[key], rtol=TOLERANCE, atol=TOLERANCE, msg=f"{kind} {key}")
