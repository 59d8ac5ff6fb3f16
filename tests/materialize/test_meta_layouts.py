"""A model built on the meta device trains under every layout as the same script does in one process.

Each case is one script: build the model without memory (``with torch.device("meta")`` around the annotated
construction, or the config key ``model.meta_init`` with the construction left as it is), ``epl.parallelize``,
4 AdamW steps. Run on several processes it must equal the same script run in one process (which also builds
on meta): losses and every parameter (gathered whole) within ``TOLERANCE`` (float64). Each rank holds only its
part: after ``parallelize`` no rank's model holds a ``meta`` tensor, and its elements are its share; under ZeRO
the model is chunked before it gets values, so that ``parallelize`` never allocates the whole model on a rank.

- 2 processes: data parallel with ZeRO v2 (Llama, head tied to the embedding); split(2) of GPT-2 (fused q/k/v,
  tied head) built with ``model.meta_init``; 2 pipeline stages cut automatically (Llama, tied embedding and head
  on different stages); split(2) of Mixtral (expert parallel; the routing reads the weights); a model written
  by hand whose modules have ``reset_parameters``, data parallel.
- 4 processes: Llama as split(2) x 2 stages (3D), tied embedding and head.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import pytest
import torch
from torch import nn

from epl_memory.measure import peak_allocated_bytes
from tests.helpers.distributed import run_ranks
from tests.materialize import models

pytestmark = pytest.mark.multiprocess

ROWS, STEPS, MICRO = 4, 4, 2
TOLERANCE = 1e-10


def token_loss(outputs: Any, tokens: torch.Tensor) -> torch.Tensor:
    logits = getattr(outputs, "logits", outputs)
    return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def batches(rows: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, models.VOCABULARY, (rows, models.SEQUENCE), generator=generator) for _ in range(STEPS)]


#: Each case: the model, the config, the annotation ("split" or none), how the model is put on meta, the
#: replicas of the distributed run (the one-process run trains on all their rows).
CASES: dict[str, dict[str, Any]] = {
    "llama dp zero v2": {"model": "llama", "config": {"zero.level": "v2"}, "replicas": 2},
    "gpt2 split meta_init": {"model": "gpt2", "split": 2, "config": {"model.meta_init": True}},
    "llama 2 stages": {"model": "llama", "config": {"auto.auto_parallel": True, "pipeline.num_stages": 2}},
    "mixtral split": {"model": "mixtral", "split": 2},
    "handwritten dp": {"model": "handwritten", "config": {"model.meta_init": True}, "replicas": 2},
    "llama 3d": {"model": "llama", "split": 2, "config": {"auto.auto_parallel": True, "pipeline.num_stages": 2}},
}
TWO_PROCESSES = [name for name in CASES if name != "llama 3d"]


def build(case: dict[str, Any]) -> nn.Module:
    """The case's model in float64, on meta: by ``with torch.device("meta")`` unless the config says
    ``model.meta_init``."""
    import epl

    make: Callable[[], nn.Module] = models.MODELS[case["model"]]
    split = case.get("split", 1)
    on_meta = torch.device("meta") if not case.get("config", {}).get("model.meta_init") else nullcontext()
    with on_meta, epl.split(split) if split > 1 else nullcontext():
        model = make()
    return model.double()


def train(name: str) -> dict[str, Any]:
    """The case's script on this process: its losses, whole parameters, and what this rank holds."""
    import epl

    case = CASES[name]
    torch.manual_seed(0)
    epl.init(epl.Config({"pipeline.num_micro_batch": MICRO, **case.get("config", {})}))
    made: list[Any] = []
    built = peak_allocated_bytes(lambda: made.append(epl.parallelize(build(case), optimizer=adamw, loss_fn=token_loss)))
    engine = made[0]
    on_meta = [n for n, t in engine.model.state_dict(keep_vars=True).items() if t.is_meta]
    held = sum(p.numel() for p in engine.parameters())
    losses = []
    replicas = case.get("replicas", 1)
    for tokens in batches(ROWS * replicas):
        share = len(tokens) // engine.num_replicas
        rows = tokens[engine.replica_index * share : (engine.replica_index + 1) * share]
        losses.append(float(engine.step(rows, rows)))
    state = engine.state_dict(full=True)["model"]
    return {
        "losses": losses,
        "state": {k: v.detach().clone() for k, v in state.items()},
        "on_meta": on_meta,
        "held": held,
        "built": built,
        "whole_bytes": sum(t.nbytes for t in state.values()),
        "replica": engine.replica_index,
    }


def train_cases(names: list[str]) -> dict[str, dict[str, Any]]:
    return {name: train(name) for name in names}


@pytest.fixture(scope="module")
def two_processes() -> list[dict[str, dict[str, Any]]]:
    return run_ranks(train_cases, 2, TWO_PROCESSES, timeout=400)


def _assert_equal_to_one_process(name: str, results: list[dict[str, Any]]) -> None:
    expected = train(name)  # the same script in this process: one process, the whole model
    assert expected["on_meta"] == []
    whole = expected["held"]
    replicas = CASES[name].get("replicas", 1)
    # A step returns its replica's loss: the replicas' mean is the one-process loss of all their rows.
    losses = torch.tensor([r["losses"] for r in results], dtype=torch.float64).mean(0).tolist()
    torch.testing.assert_close(losses, expected["losses"], rtol=TOLERANCE, atol=TOLERANCE)
    # Every parameter is held by some rank (a pipeline rank gathers its own stage's), under its own name.
    assert set().union(*(r["state"].keys() for r in results)) == expected["state"].keys()
    for result in results:
        assert result["on_meta"] == []
        if replicas == 1:
            torch.testing.assert_close(result["losses"], expected["losses"], rtol=TOLERANCE, atol=TOLERANCE)
        for key, value in result["state"].items():
            torch.testing.assert_close(value, expected["state"][key], rtol=TOLERANCE, atol=TOLERANCE, msg=key)
        if replicas == 1 or "zero.level" in CASES[name].get(
            "config", {}
        ):  # a split, a stage, chunks: each rank its part
            assert result["held"] < 0.8 * whole, (name, result["held"], whole)
        if "zero.level" in CASES[name].get(
            "config", {}
        ):  # chunked before given values: the whole model never on a rank
            assert result["built"] < 0.8 * result["whole_bytes"], (name, result["built"], result["whole_bytes"])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", TWO_PROCESSES)
def test_a_model_built_on_meta_equals_the_one_process_run(
    two_processes: list[dict[str, dict[str, Any]]], name: str
) -> None:
    _assert_equal_to_one_process(name, [ranks[name] for ranks in two_processes])


@pytest.mark.timeout(600)
def test_3d_of_a_model_built_on_meta_equals_the_one_process_run() -> None:
    results = run_ranks(train_cases, 4, ["llama 3d"], timeout=400)
    _assert_equal_to_one_process("llama 3d", [ranks["llama 3d"] for ranks in results])
    whole = sum(p.numel() for p in models.llama().parameters())
    assert all(ranks["llama 3d"]["held"] < 0.4 * whole for ranks in results)
