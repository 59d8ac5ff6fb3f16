"""ZeRO under split, pipelines and hybrid sharding, on transformers' Llama, against one process (float64); and every
parameter readable after parallelize and after a step in each layout. One launch of 4 processes."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.multiprocess

VOCABULARY, BATCH, SEQUENCE, STEPS = 96, 8, 8, 2
#: The mean over 2 or 4 replicas and the chunks' reductions add in another order than one process.
TOLERANCE = 1e-10

LAYOUTS: dict[str, dict[str, Any]] = {
    "hybrid sharding (2 x 2)": {"zero.level": "v2", "zero.shard_degree": 2},
    "split(2) x 2 replicas": {"zero.level": "v2"},
    "2 stages x 2 replicas": {
        "zero.level": "v1",
        "pipeline.num_stages": 2,
        "auto.auto_parallel": True,
        "pipeline.num_micro_batch": 2,
    },  # fmt: skip
    # offload on FSDP2: on these CPUs the host is the device, so this proves the layouts' arithmetic and bookkeeping
    "offload, 2 stages x 2 replicas": {
        "offload.level": "v0",
        "pipeline.num_stages": 2,
        "auto.auto_parallel": True,
        "pipeline.num_micro_batch": 2,
    },  # fmt: skip
    "offload with zero v1, split(2) x 2 replicas": {"offload.level": "v0", "zero.level": "v1"},
    # a zero-bubble schedule's weight gradients come after its input gradients: reduced once, at the step's end
    "zero v2, zero bubble, 2 stages x 2 replicas": {
        "zero.level": "v2",
        "pipeline.num_stages": 2,
        "pipeline.strategy": "ZeroBubble",
        "auto.auto_parallel": True,
        "pipeline.num_micro_batch": 2,
    },  # fmt: skip
    "offload, zero bubble, 2 stages x 2 replicas": {
        "offload.level": "v0",
        "pipeline.num_stages": 2,
        "pipeline.strategy": "ZeroBubble",
        "auto.auto_parallel": True,
        "pipeline.num_micro_batch": 2,
    },  # fmt: skip
}


def llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCABULARY, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, attn_implementation="eager",
    )  # fmt: skip
    return LlamaForCausalLM(config).double()


def batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCABULARY, (BATCH, SEQUENCE), generator=generator) for _ in range(STEPS)]


def readable(engine: Any) -> dict[str, Any]:
    """What one rank reads of its parameters on its own, and the whole tensors full_parameters() shows."""
    local = list(engine.parameters())
    seen = {
        "numpy": sum(float(p.numpy().sum()) for p in local),
        "std": [float(p.std()) for p in local if p.numel() > 1],
        "held": sum(p.numel() for p in local),
    }
    with engine.full_parameters():
        seen["whole"] = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    return seen


def train(name: str) -> dict[str, Any]:
    import epl

    config = LAYOUTS[name]
    epl.init(epl.Config(config))
    scope = epl.split(2) if "split" in name else contextlib.nullcontext()
    with scope:
        model = llama()
    engine = epl.parallelize(model, optimizer=lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1))
    after_parallelize = readable(engine)
    losses = []
    for tokens in batches():
        share = BATCH // engine.num_replicas
        rows = tokens[share * engine.replica_index : share * (engine.replica_index + 1)]
        losses.append(float(engine.step({"input_ids": rows, "labels": rows})))
    chunks = {name: p.to_local().shape[0] for name, p in engine.model.named_parameters() if hasattr(p, "to_local")}
    return {
        "losses": losses,
        "replicas": engine.num_replicas,
        "state": engine.state_dict(full=True)["model"],
        "after parallelize": after_parallelize,
        "after a step": readable(engine),
        "chunks": chunks,
    }


def every_layout() -> dict[str, Any]:
    return {name: train(name) for name in LAYOUTS}


def in_one_process() -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same steps in this process over the whole batch (the mean of the replicas' mean losses)."""
    model = llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    losses = []
    for tokens in batches():
        optimizer.zero_grad()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, model.state_dict()


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(every_layout, 4, timeout=600)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_zero_in_each_layout_trains_as_one_process(ranks: list[dict[str, Any]], name: str) -> None:
    losses, state = in_one_process()
    results = [rank[name] for rank in ranks]
    assert {result["replicas"] for result in results} == {4 if "4" in name or name.startswith("hybrid") else 2}
    # the replicas' mean loss is the whole batch's (each replica's loss is of its rows; stages report the last's)
    first = results[0]["losses"]
    assert all(len(result["losses"]) == STEPS for result in results)
    if results[0]["replicas"] == 4:
        assert first != results[1]["losses"]  # 4 replicas, each its own rows
    for result in results:  # a pipeline stage holds its layers only: every tensor is on some stage
        for key, value in result["state"].items():
            torch.testing.assert_close(value, state[key], rtol=TOLERANCE, atol=TOLERANCE, msg=key)
    assert set().union(*(result["state"] for result in results)) == set(state)
    for moment in ("after parallelize", "after a step"):
        for result in results:
            seen = result[moment]
            for key, value in seen["whole"].items():  # full_parameters() shows the model's tensors whole
                if key in result["state"] and moment == "after a step" and "split" not in name:
                    torch.testing.assert_close(value, result["state"][key], rtol=0, atol=0, msg=key)
            assert seen["held"] > 0


def test_hybrid_sharding_chunks_over_groups_of_two(ranks: list[dict[str, Any]]) -> None:
    """zero.shard_degree 2 over 4 copies: each tensor is cut in 2 (not 4), each half held by 2 ranks."""
    chunks = [rank["hybrid sharding (2 x 2)"]["chunks"] for rank in ranks]
    rows = llama().state_dict()
    for key, held in chunks[0].items():
        assert held == -(-rows[key].shape[0] // 2), key
    assert chunks[0] == chunks[2] and chunks[1] == chunks[3]
