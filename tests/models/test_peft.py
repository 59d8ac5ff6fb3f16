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
  a gradient or optimizer state;
- context parallelism of degree 2.
"""

from __future__ import annotations

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


def train_here(micro: int, replicas: int = 1) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The one-process reference: each batch in ``micro`` micro-batches (per replica), one AdamW step."""
    model = peft_llama()
    optimizer = adamw(model.parameters())
    losses = []
    for tokens in batches(ROWS * replicas):
        optimizer.zero_grad()
        parts = []
        for part in tokens.chunk(micro * replicas):
            loss = token_loss(model(input_ids=part), part)
            (loss / (micro * replicas)).backward()
            parts.append(loss.detach())
        optimizer.step()
        losses.append(float(torch.stack(parts).mean()))
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
    frozen = [p for p in engine.parameters() if not p.requires_grad]
    state = engine.optimizer.state
    return {
        "losses": losses,
        "state": {k: v.detach().clone() for k, v in engine.state_dict(full=True)["model"].items()},
        "frozen_with_grad": sum(1 for p in frozen if p.grad is not None),
        "frozen_with_state": sum(1 for p in frozen if p in state and state[p]),
        "frozen": len(frozen),
        "held": sum(p.numel() for p in engine.parameters()),
    }


def assert_equal_to_local(results: list[dict[str, Any]], micro: int, replicas: int = 1) -> None:
    losses, full = train_here(micro, replicas)
    assert {name for result in results for name in result["state"]} == full.keys()  # each stage holds its part
    for result in results:
        torch.testing.assert_close(result["losses"], losses, rtol=TOLERANCE, atol=TOLERANCE)
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
