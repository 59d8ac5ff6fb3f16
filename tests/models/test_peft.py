"""PEFT's LoRA on transformers' Llama under EPL's layouts, equal to the same script in one process.

A tiny Llama (random weights, float64, nothing downloaded) is wrapped by ``peft.get_peft_model``
with LoRA on every projection (q, k, v, o, gate, up, down; rank 4, random ``lora_B`` so that the
adapters change the output from the first step), its base frozen. Each layout trains 3 AdamW steps
of 2 micro-batches (the pipelines; 1 elsewhere) and is compared with one process: losses and every
parameter (gathered whole) within ``TOLERANCE``. The frozen base stays as it was.

- ``epl.split(2)``: the wrapped layers keep Megatron's pairing (a wrapped ``o_proj`` row parallel,
  its ``lora_A`` cut by input columns, a wrapped ``q_proj`` column parallel, its ``lora_B`` cut by
  output rows); the collectives a step issues are counted with the profiler against the same model
  without adapters (``ADAPTER_COLLECTIVES_PER_BLOCK``);
- an automatic 2-stage pipeline (``auto.auto_parallel``): the wrappers ``PeftModel`` and ``LoraModel``
  are looked through, so the decoder's layers are cut;
- ``epl.split(2)`` x 2 automatic stages on 4 processes;
- ZeRO ``v2`` over 2 replicas: the frozen base is sharded like the rest, and no frozen parameter holds
  a gradient or optimizer state; and ``epl.split(2)`` x 2 replicas with ZeRO ``v2`` on 4 processes;
- context parallelism of degree 2.

In every layout no frozen parameter holds a gradient or optimizer state.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.multiprocess

VOCABULARY, SEQUENCE, ROWS, STEPS, MICRO = 64, 8, 4, 3, 2
#: Relative and absolute tolerance of losses and parameters (float64).
TOLERANCE = 1e-10
LAYERS = 2
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def llama() -> nn.Module:
    """A 2-layer Llama: grouped-query attention (4 heads, 2 key/value heads), SwiGLU, untied head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCABULARY,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def peft_llama(*, adapters: bool = True) -> nn.Module:
    """The Llama from seed 0 in float64, with LoRA on every projection (base frozen) when ``adapters``."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = llama()
    if adapters:
        config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=PROJECTIONS, init_lora_weights=False)
        model = get_peft_model(model, config)
    return model.double()


def built(split: int = 1, *, adapters: bool = True) -> nn.Module:
    """:func:`peft_llama`, inside an ``epl.split(split)`` scope when ``split > 1``."""
    import epl

    if split == 1:
        return peft_llama(adapters=adapters)
    with epl.split(split):
        return peft_llama(adapters=adapters)


def token_loss(outputs: Any, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each position's logits against the next token."""
    logits = outputs.logits
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def batches(rows: int = ROWS) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCABULARY, (rows, SEQUENCE), generator=generator) for _ in range(STEPS)]


def adamw(params: Any) -> torch.optim.Optimizer:
    """AdamW over the parameters that learn (the adapters)."""
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-2, weight_decay=0.01)


def train_here(micro: int, replicas: int = 1) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """The one-process reference: each replica's rows in ``micro`` micro-batches, the replicas' gradients averaged,
    one AdamW step. Returns each replica's losses (the mean over its micro-batches) and the parameters."""
    model = peft_llama()
    optimizer = adamw(model.parameters())
    losses: list[list[float]] = [[] for _ in range(replicas)]
    for tokens in batches(ROWS * replicas):
        optimizer.zero_grad()
        for replica, rows in enumerate(tokens.chunk(replicas)):
            parts = []
            for part in rows.chunk(micro):
                loss = token_loss(model(input_ids=part), part)
                (loss / (micro * replicas)).backward()
                parts.append(loss.detach())
            losses[replica].append(float(torch.stack(parts).mean()))
        optimizer.step()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(config: dict[str, Any], split: int = 1, replicas: int = 1, *, adapters: bool = True) -> dict[str, Any]:
    """One rank: train the adapted Llama under ``config``; its losses, whole parameters and what it holds."""
    import epl

    epl.init(epl.Config(config))
    model = built(split, adapters=adapters)
    engine = epl.parallelize(model, optimizer=adamw, loss_fn=token_loss)
    losses = []
    for tokens in batches(ROWS * replicas):
        index = engine.replica_index
        rows = tokens[index * ROWS : (index + 1) * ROWS] if replicas > 1 else tokens
        losses.append(float(engine.step({"input_ids": rows}, rows)))
    return report(engine, losses)


def report(engine: Any, losses: list[float], **extra: Any) -> dict[str, Any]:
    """What one rank reports: its losses, the model gathered whole (a collective), what it holds, and whether any
    frozen parameter holds a gradient or optimizer state."""
    frozen = [p for p in engine.parameters() if not p.requires_grad]
    state = engine.optimizer.state
    return {
        "losses": losses,
        "replica": engine.replica_index,
        "state": {k: v.detach().clone() for k, v in engine.state_dict(full=True)["model"].items()},
        "frozen_with_grad": sum(1 for p in frozen if p.grad is not None),
        "frozen_with_state": sum(1 for p in frozen if p in state and state[p]),
        "frozen": len(frozen),
        "held": sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in engine.parameters()),
        **extra,
    }


def assert_equal_to_local(results: list[dict[str, Any]], micro: int, replicas: int = 1) -> None:
    losses, full = train_here(micro, replicas)
    assert {name for result in results for name in result["state"]} == full.keys()  # each stage holds its part
    for result in results:
        expected = losses[result["replica"]]
        torch.testing.assert_close(result["losses"], expected, rtol=TOLERANCE, atol=TOLERANCE)
        for name, value in result["state"].items():
            torch.testing.assert_close(value, full[name], rtol=TOLERANCE, atol=TOLERANCE, msg=name)
        assert result["frozen"] and not result["frozen_with_grad"] and not result["frozen_with_state"]


def auto_pipeline() -> dict[str, Any]:
    return train({"auto.auto_parallel": True, "pipeline.num_stages": 2, "pipeline.num_micro_batch": MICRO})


@pytest.mark.timeout(300)
def test_an_automatic_pipeline_of_a_peft_model_equals_one_process() -> None:
    """``PeftModel`` -> ``LoraModel`` -> ``LlamaForCausalLM`` is opened to the decoder's layers: 2 balanced stages."""
    results = run_ranks(auto_pipeline, 2, timeout=240)
    assert_equal_to_local(results, MICRO)
    total = sum(p.numel() for p in peft_llama().parameters())
    assert sum(result["held"] for result in results) == total
    assert all(result["held"] < 0.75 * total for result in results)


def split_pipeline() -> dict[str, Any]:
    config = {"auto.auto_parallel": True, "pipeline.num_stages": 2, "pipeline.num_micro_batch": MICRO}
    return train(config, split=2)


@pytest.mark.timeout(400)
def test_split_stages_of_a_peft_model_equal_one_process() -> None:
    assert_equal_to_local(run_ranks(split_pipeline, 4, timeout=340), MICRO)


def split_run(adapters: bool) -> dict[str, Any]:
    """One rank: the model (with or without adapters) under ``epl.split(2)``, trained; the collectives of its last
    step counted by the profiler, by operation and shape (the batch check off)."""
    import logging

    from benchmarks.collectives import collectives_of

    import epl

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("epl").addHandler(Keep(logging.WARNING))
    epl.init(epl.Config({"io.check_batches": False}))
    engine = epl.parallelize(built(2, adapters=adapters), optimizer=adamw, loss_fn=token_loss)
    losses = []
    counts: dict[str, int] = {}
    for tokens in batches():
        counts = collectives_of(functools.partial(step, engine, tokens, losses)).counts
    return report(engine, losses, collectives=counts, repr=repr(engine.model), warnings=records)


def step(engine: Any, tokens: torch.Tensor, losses: list[float]) -> None:
    losses.append(float(engine.step({"input_ids": tokens}, tokens)))


def split_both() -> dict[str, Any]:
    return {"adapters": split_run(True), "plain": split_run(False)}


@pytest.fixture(scope="module")
def split_ranks() -> list[dict[str, Any]]:
    """Both ranks' results, with adapters and without (one launch of 2 processes)."""
    return run_ranks(split_both, 2, timeout=240)


@pytest.mark.timeout(300)
def test_split_of_a_peft_model_equals_one_process(split_ranks: list[dict[str, Any]]) -> None:
    assert_equal_to_local([result["adapters"] for result in split_ranks], 1)


#: What the adapters add to a step under split(2), per transformer block: for each row-parallel wrapped layer
#: (o_proj, down_proj), the all-reduce of its lora_A's partial output forward; for each column-parallel one (q, k,
#: v, gate, up), the all-reduce of the gradient of its lora_B's input backward. Each is [batch, sequence, rank].
ADAPTER_COLLECTIVES_PER_BLOCK = 2 + 5
#: What the frozen base saves: the gradient of the first block's input to attention (Megatron's backward all-reduce
#: there) is not needed when the embedding below it learns nothing.
FROZEN_EMBEDDING_SAVES = 1


@pytest.mark.timeout(300)
def test_adapters_keep_megatrons_collectives(split_ranks: list[dict[str, Any]]) -> None:
    """The base layers' collectives are those of the model without adapters; the adapters add only their own."""
    width, rank = f"[{ROWS}, {SEQUENCE}, 32]", f"[{ROWS}, {SEQUENCE}, 4]"
    for result in split_ranks:
        plain, adapted = dict(result["plain"]["collectives"]), dict(result["adapters"]["collectives"])
        assert adapted.pop(f"allreduce {rank}") == ADAPTER_COLLECTIVES_PER_BLOCK * LAYERS
        plain[f"allreduce {width}"] -= FROZEN_EMBEDDING_SAVES
        assert adapted == plain
        assert not [w for w in result["adapters"]["warnings"] if "more collectives" in w]
    model = split_ranks[0]["adapters"]["repr"]
    for layer in ("o_proj", "down_proj"):
        assert f"({layer}): lora.Linear(\n                (base_layer): RowParallelLinear" in model
    for layer in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        assert f"({layer}): lora.Linear(\n                (base_layer): ColumnParallelLinear" in model
    assert "role=column" in model and "role=alone" not in model
    assert "adapter of a column layer" in model


def zero_v2() -> dict[str, Any]:
    return train({"zero.level": "v2"}, replicas=2)


@pytest.mark.timeout(300)
def test_zero_v2_of_a_peft_model_equals_one_process() -> None:
    """Two replicas, ZeRO v2: every parameter, the frozen base too, is sharded over them; frozen ones hold no
    gradient and no optimizer state."""
    results = run_ranks(zero_v2, 2, timeout=240)
    assert_equal_to_local(results, 1, replicas=2)
    total = sum(p.numel() for p in peft_llama().parameters())
    assert all(result["held"] <= total // 2 + 64 for result in results)


def context_parallel() -> dict[str, Any]:
    return train({"context.degree": 2})


@pytest.mark.timeout(300)
def test_context_parallelism_of_a_peft_model_equals_one_process() -> None:
    assert_equal_to_local(run_ranks(context_parallel, 2, timeout=240), 1)


def split_replicas_zero() -> dict[str, Any]:
    return train({"zero.level": "v2"}, split=2, replicas=2)


@pytest.mark.timeout(300)
def test_split_replicas_with_zero_v2_of_a_peft_model_equal_one_process() -> None:
    """split(2) x 2 replicas on 4 processes, ZeRO v2 over the replicas: the adapters' shards reduced as the base's."""
    assert_equal_to_local(run_ranks(split_replicas_zero, 4, timeout=240), 1, replicas=2)
