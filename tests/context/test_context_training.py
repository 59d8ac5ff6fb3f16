"""``context.degree`` on transformers' Llama (grouped-query attention), float64, against one process: the losses and
every parameter after 3 AdamW steps within 1e-10, for causal, right-padded and packed-document batches (the model
built with ``use_cache=False``, so that transformers itself reads the documents from ``position_ids``), in each
mode; with data parallelism beside it (2 replicas x 2 context devices on 4 processes); and the model's own loss
(``labels`` in the batch, which transformers computes in float32) within float32's tolerance."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.multiprocess

BATCH, SEQUENCE, STEPS, VOCABULARY = 4, 16, 3, 96
TOLERANCE = 1e-10


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCABULARY, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa", use_cache=False,
    )  # fmt: skip
    return LlamaForCausalLM(config).double()


def batches(kind: str) -> list[dict[str, torch.Tensor]]:
    """``STEPS`` replica batches of ``kind``: causal, right-padded (a mask and -100 labels), packed documents."""
    generator = torch.Generator().manual_seed(3)
    found = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCABULARY, (BATCH, SEQUENCE), generator=generator)
        batch = {"input_ids": tokens, "targets": tokens.clone()}
        if kind == "right-padded":
            mask = torch.ones(BATCH, SEQUENCE, dtype=torch.long)
            mask[1, 10:] = 0
            mask[3, 5:] = 0
            batch["attention_mask"] = mask
            batch["targets"] = tokens.masked_fill(mask == 0, -100)
        elif kind == "packed documents":
            lengths = [[5, 7, 4], [16], [9, 7], [3, 3, 10]]
            batch["position_ids"] = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
        found.append(batch)
    return found


def next_token_loss(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    logits = getattr(outputs, "logits", outputs)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), targets[:, 1:].flatten(), ignore_index=-100)


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def locally(kind: str, own_loss: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = llama()
    optimizer = adamw(model.parameters())
    losses = []
    for batch in batches(kind):
        inputs = {k: v for k, v in batch.items() if k != "targets"}
        optimizer.zero_grad()
        if own_loss:
            loss = model(**inputs, labels=batch["targets"]).loss
        else:
            loss = next_token_loss(model(**inputs), batch["targets"])
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def train(runs: list[tuple[str, str, bool]]) -> dict[tuple[str, str, bool], dict[str, Any]]:
    import epl

    results = {}
    for kind, mode, own_loss in runs:
        epl.init(epl.Config({"context.degree": 2, "context.mode": mode}))
        engine = epl.parallelize(llama(), optimizer=adamw, loss_fn=None if own_loss else next_token_loss)
        losses = []
        for batch in batches(kind):
            share = slice(engine.replica_index * BATCH // engine.num_replicas,
                          (engine.replica_index + 1) * BATCH // engine.num_replicas)  # fmt: skip
            inputs = {k: v[share] for k, v in batch.items() if k != "targets"}
            if own_loss:
                losses.append(float(engine.step({**inputs, "labels": batch["targets"][share]})))
            else:
                losses.append(float(engine.step(inputs, batch["targets"][share])))
        results[kind, mode, own_loss] = {
            "losses": losses,
            "state": {k: v.detach().clone() for k, v in engine.model.state_dict().items()},
            "replicas": engine.num_replicas,
            "sent": dict(engine.context.context_group.collectives),
        }
    return results


KINDS = ["causal", "right-padded", "packed documents"]
RUNS = [(kind, "ring", False) for kind in KINDS] + [
    ("packed documents", "allgather", False),
    ("right-padded", "ulysses", False),
    ("causal", "ring", True),
]


@pytest.fixture(scope="module")
def two_processes() -> list[dict[tuple[str, str, bool], dict[str, Any]]]:
    return run_ranks(train, 2, RUNS, timeout=400)


def check(result: dict[str, Any], expected: tuple[list[float], dict[str, torch.Tensor]], tolerance: float) -> None:
    losses, state = expected
    torch.testing.assert_close(result["losses"], losses, rtol=tolerance, atol=tolerance)
    for name, value in result["state"].items():
        torch.testing.assert_close(value, state[name], rtol=tolerance, atol=tolerance, msg=name)


@pytest.mark.timeout(500)
@pytest.mark.parametrize("run", RUNS, ids=lambda run: f"{run[0]}-{run[1]}{'-own loss' if run[2] else ''}")
def test_two_context_devices_train_as_one_process(
    two_processes: list[dict[tuple[str, str, bool], dict[str, Any]]], run: tuple[str, str, bool]
) -> None:
    kind, _, own_loss = run
    expected = locally(kind, own_loss)
    for result in two_processes:
        assert result[run]["replicas"] == 1
        check(result[run], expected, 1e-5 if own_loss else TOLERANCE)


@pytest.mark.timeout(500)
def test_two_replicas_of_two_context_devices_train_as_one_process() -> None:
    """Each replica trains on half the rows (every row has as many tokens): the replicas' mean loss is the local
    run's, and the parameters are the same."""
    losses, state = locally("packed documents")
    results = [r["packed documents", "ring", False] for r in run_ranks(train, 4, [("packed documents", "ring", False)],
                                                                       timeout=400)]  # fmt: skip
    assert {r["replicas"] for r in results} == {2}
    mean = [sum(values) / len(values) for values in zip(*(r["losses"] for r in results), strict=True)]
    torch.testing.assert_close(mean, losses, rtol=TOLERANCE, atol=TOLERANCE)
    for result in results:
        check({"losses": losses, "state": result["state"]}, (losses, state), TOLERANCE)


def train_with(config: dict[str, Any], kind: str) -> dict[str, Any]:
    """One rank under ``config`` (context.degree with ZeRO, checkpointing, or 4 context devices)."""
    import epl

    epl.init(epl.Config(config))
    engine = epl.parallelize(llama(), optimizer=adamw, loss_fn=next_token_loss)
    losses = []
    for batch in batches(kind):
        share = slice(engine.replica_index * BATCH // engine.num_replicas,
                      (engine.replica_index + 1) * BATCH // engine.num_replicas)  # fmt: skip
        losses.append(float(engine.step({k: v[share] for k, v in batch.items() if k != "targets"},
                                        batch["targets"][share])))  # fmt: skip
    state = engine.state_dict(full=True)["model"]
    return {"losses": losses, "state": state, "replicas": engine.num_replicas}


COMPOSED = {
    "4 context devices": ({"context.degree": 4}, 4),
    "ZeRO v1, 2 replicas": ({"context.degree": 2, "zero.level": "v1"}, 4),
    "ZeRO v2, 2 replicas": ({"context.degree": 2, "zero.level": "v2"}, 4),
    "checkpointing": ({"context.degree": 2, "gradient_checkpoint.type": "auto"}, 2),
    "selective checkpointing": ({"context.degree": 2, "gradient_checkpoint.type": "selective"}, 2),
}


@pytest.mark.timeout(500)
@pytest.mark.parametrize("name", list(COMPOSED))
def test_context_parallelism_composes_with_zero_and_checkpointing(name: str) -> None:
    config, processes = COMPOSED[name]
    losses, state = locally("packed documents")
    results = run_ranks(train_with, processes, config, "packed documents", timeout=400)
    replicas = results[0]["replicas"]
    mean = [sum(values) / len(values) for values in zip(*(r["losses"] for r in results), strict=True)]
    torch.testing.assert_close(mean, losses, rtol=TOLERANCE, atol=TOLERANCE)
    for result in results:
        assert result["replicas"] == replicas
        for key, value in result["state"].items():
            torch.testing.assert_close(value, state[key], rtol=TOLERANCE, atol=TOLERANCE, msg=key)


def train_presliced(kinds: list[str]) -> dict[str, Any]:
    """``context.presliced``: each rank is given only its share of every sequence (cut by ``epl.context.my_share``),
    with global ``position_ids`` and ``shift_labels``; and the clear errors for ``labels`` and a ``loss_fn``."""
    import epl
    from epl.context import my_share

    results: dict[str, Any] = {}
    for kind in kinds:
        epl.init(epl.Config({"context.degree": 2, "context.presliced": True}))
        engine = epl.parallelize(llama(), optimizer=adamw)
        losses = []
        for batch in batches(kind):
            labels = batch["targets"]
            whole = {
                "input_ids": batch["input_ids"],
                "position_ids": batch.get("position_ids", torch.arange(SEQUENCE).expand(BATCH, SEQUENCE)),
                "shift_labels": torch.cat([labels[:, 1:], labels.new_full((BATCH, 1), -100)], 1),
            }
            if "attention_mask" in batch:
                whole["attention_mask"] = batch["attention_mask"]
            losses.append(float(engine.step({k: my_share(v, engine) for k, v in whole.items()})))
        results[kind] = {"losses": losses, "state": engine.state_dict(full=True)["model"]}
    for name, loss_fn, batch in [("labels", None, "labels"), ("loss_fn", next_token_loss, None)]:
        try:
            epl.init(epl.Config({"context.degree": 2, "context.presliced": True}))
            engine = epl.parallelize(llama(), optimizer=adamw, loss_fn=loss_fn)
            tokens = my_share(batches("causal")[0]["input_ids"], engine)
            engine.step({"input_ids": tokens, "position_ids": my_share(torch.arange(SEQUENCE).expand(BATCH, SEQUENCE),
                                                                       engine), batch: tokens})  # fmt: skip
            results[name] = "no error"
        except epl.errors.EplError as error:
            results[name] = str(error)
    return results


@pytest.mark.timeout(500)
def test_a_loader_that_gives_each_rank_its_share_trains_as_one_process() -> None:
    """Right-padded and packed batches, each rank given its share: as the model's own loss on one process (which
    transformers computes in float32: within 1e-5)."""
    kinds = ["right-padded", "packed documents"]
    results = run_ranks(train_presliced, 2, kinds, timeout=400)
    for kind in kinds:
        expected = locally(kind, own_loss=True)
        for result in results:
            check({"losses": result[kind]["losses"], "state": result[kind]["state"]}, expected, 1e-5)
    assert "shift_labels" in results[0]["labels"] and "not labels" in results[0]["labels"]
    assert "loss_fn" in results[0]["loss_fn"] and "context.presliced to False" in results[0]["loss_fn"]
