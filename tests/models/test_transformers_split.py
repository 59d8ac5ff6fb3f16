"""transformers' models, unmodified, under one ``epl.split(2)`` scope, equal the local run.

Llama (grouped-query attention, RMSNorm, rotary embeddings, SwiGLU), Mistral and Qwen2
(the same shape; Qwen2 with q/k/v biases), GPT-2 (Conv1D, fused q/k/v ``c_attn``, LM
head tied to the embedding), BERT (embeddings with buffers, a classification head),
Mixtral, Qwen2-MoE (a shared expert and its one-output gate) and Qwen3-MoE (norms of
each attention head) with fused experts (expert parallel), and a Llama written by hand
the torchtitan way (:mod:`tests.models.handwritten_llama`): tiny configs, random
weights, nothing downloaded, float64 (Mixtral, on transformers' default grouped expert
products, float32). Each trains 4 AdamW steps on 2
processes and on one; losses and parameters (gathered whole) agree within
``TOLERANCE``. No rules, no edits: the layout comes from the model's computation.

The collectives of one step are counted per transformer block and compared with
Megatron-LM's: one all-reduce forward after attention and one after the MLP, one
backward for the gradient of each block's input to attention and to the MLP.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers.distributed import run_ranks
from tests.helpers.reference import assert_rank_matches, train_locally
from tests.models import handwritten_llama

pytestmark = pytest.mark.multiprocess

BATCH, SEQUENCE, STEPS, VOCABULARY = 4, 8, 4, 96
#: Relative and absolute tolerance of losses and parameters (float64).
TOLERANCE = 1e-10
LAYERS = 2
#: What the decoder-only models share: 4 attention heads over 2 key/value heads (grouped-query attention).
DECODER: dict[str, Any] = {
    "vocab_size": VOCABULARY,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "attn_implementation": "sdpa",
}


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**DECODER))


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCABULARY,
        n_positions=32,
        n_embd=32,
        n_layer=LAYERS,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="sdpa",
    )
    return GPT2LMHeadModel(config)


def bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=VOCABULARY,
        hidden_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
        attn_implementation="sdpa",
    )
    return BertForSequenceClassification(config)


def mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(**DECODER, num_local_experts=4, num_experts_per_tok=2))


def mistral() -> nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(**DECODER, sliding_window=4))


def qwen2() -> nn.Module:
    """Qwen2: Llama's shape with biases on q, k and v."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**DECODER))


#: The fused experts of the Qwen MoE models: 4 of 16 features, 2 per token, run by transformers' loop over experts
#: (float64; its default grouped products take float32 only: see Mixtral).
QWEN_EXPERTS: dict[str, Any] = {
    "moe_intermediate_size": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "experts_implementation": "eager",
}


def qwen2_moe() -> nn.Module:
    """Qwen2-MoE: fused experts, a shared expert (an MLP) and its gate of one output (kept whole)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return Qwen2MoeForCausalLM(Qwen2MoeConfig(**DECODER, **QWEN_EXPERTS, shared_expert_intermediate_size=24))


def qwen3_moe() -> nn.Module:
    """Qwen3-MoE: fused experts, and q/k norms over each head (whole weights applied to sharded heads)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**DECODER, **QWEN_EXPERTS, head_dim=8))


def torchtitan_llama() -> nn.Module:
    return handwritten_llama.Transformer(
        handwritten_llama.ModelArgs(dim=32, n_layers=LAYERS, n_heads=4, n_kv_heads=2, vocab_size=VOCABULARY)
    )


MODELS: dict[str, Callable[[], nn.Module]] = {
    "llama": llama,
    "gpt2": gpt2,
    "bert": bert,
    "mixtral": mixtral,
    "mistral": mistral,
    "qwen2": qwen2,
    "qwen2-moe": qwen2_moe,
    "qwen3-moe": qwen3_moe,
    "torchtitan llama": torchtitan_llama,
}


#: transformers' fused experts run grouped matrix products, which take no float64: Mixtral trains in float32.
FLOAT32 = {"mixtral"}
#: Relative and absolute tolerance by model: float64 runs agree to rounding; float32 runs and the hand-written
#: Llama (its rotary embedding computes in float32, as torchtitan's does) to float32 rounding.
TOLERANCES = {"mixtral": 1e-5, "torchtitan llama": 1e-6}


def built(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = MODELS[name]()
    return model if name in FLOAT32 else model.double()


def next_token_loss(outputs: Any, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each position's logits against the next token, computed by the user on ``logits``."""
    logits = getattr(outputs, "logits", outputs)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def classification_loss(outputs: Any, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs.logits, tokens[:, 0] % 3)


def loss_for(name: str) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    return classification_loss if name == "bert" else next_token_loss


def batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCABULARY, (BATCH, SEQUENCE), generator=generator) for _ in range(STEPS)]


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def train_split(name: str, config: dict[str, Any]) -> dict[str, Any]:
    """On each rank: the model built under split(2), trained; losses, whole parameters, collectives of one step."""
    import epl

    epl.init(epl.Config(config))
    with epl.split(2):
        model = built(name)
    engine = epl.parallelize(model, optimizer=adamw, loss_fn=loss_for(name))
    losses, counts = [], []
    for tokens in batches():
        groups = list(engine.context.shard_groups.values())
        before = sum((g.collectives for g in groups), Counter())
        losses.append(float(engine.step(tokens, tokens)))
        counts.append(sum((g.collectives for g in groups), Counter()) - before)
    state = engine.state_dict(full=True)["model"]
    return {
        "losses": losses,
        "state": {k: v.detach().clone() for k, v in state.items()},
        "collectives": dict(counts[-1]),
        "repr": repr(engine.model),
    }


def every_model() -> dict[str, dict[str, Any]]:
    return {name: train_split(name, {}) for name in MODELS}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, dict[str, Any]]]:
    """Both ranks' results for every model (one launch of 2 processes)."""
    return run_ranks(every_model, 2, timeout=400)


@pytest.mark.timeout(500)
@pytest.mark.parametrize("name", list(MODELS))
def test_split_equals_the_local_run(ranks: list[dict[str, Any]], name: str) -> None:
    model = built(name)
    expected, full = train_locally(model, adamw(model.parameters()), [(t, t) for t in batches()], 1, loss_for(name))
    for result in ranks:
        assert result[name]["state"].keys() == full.keys()
        assert_rank_matches(result[name], expected, full, TOLERANCES.get(name, TOLERANCE))


#: Megatron-LM's collectives per transformer block and step: an all-reduce of the attention's and of the MLP's
#: output forward, and of the gradient of their inputs backward.
MEGATRON_PER_BLOCK = {"all_reduce": 4}
#: Outside the blocks: the vocabulary-parallel embedding's all-reduce (forward), the LM head's input gradient
#: (backward) and the parallel cross-entropy's two (the row maximum, then the target logit and the sum).
OUTSIDE_BLOCKS = {"all_reduce": 4}


@pytest.mark.timeout(500)
@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "gpt2", "torchtitan llama"])
def test_collectives_per_block_are_megatrons(ranks: list[dict[str, Any]], name: str) -> None:
    """q/k/v (or c_attn) and gate/up share one entry; o and down end the regions; the logits are never gathered."""
    expected = {op: LAYERS * count + OUTSIDE_BLOCKS.get(op, 0) for op, count in MEGATRON_PER_BLOCK.items()}
    for result in ranks:
        assert result[name]["collectives"] == expected


@pytest.mark.timeout(500)
def test_the_layout_follows_megatron(ranks: list[dict[str, Any]]) -> None:
    """Column q/k/v and gate/up, row o and down, GPT-2's fused c_attn in 3 parts, the head's logits sharded."""
    llama_repr, gpt2_repr = ranks[0]["llama"]["repr"], ranks[0]["gpt2"]["repr"]
    for layer in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        assert f"({layer}): ColumnParallelLinear" in llama_repr and "role=column" in llama_repr
    for layer in ("o_proj", "down_proj"):
        assert f"({layer}): RowParallelLinear" in llama_repr
    assert "(lm_head): ColumnParallelLinear" in llama_repr and "role=logits" in llama_repr
    assert "(input_layernorm): LlamaRMSNorm" in llama_repr and "(rotary_emb): LlamaRotaryEmbedding" in llama_repr
    assert "(c_attn): ColumnParallelLinear(in_features=32, out_features=96 (shard 0 of 2: 48, 3 parts)" in gpt2_repr
    assert "(wpe): Embedding" in gpt2_repr  # positions are not the model's input: kept whole, as Megatron does
    assert "(wte): VocabParallelEmbedding" in gpt2_repr
    mixtral_repr = ranks[0]["mixtral"]["repr"]
    assert "experts 0..1 of 4 (expert parallel)" in mixtral_repr and "(gate): MixtralTopKRouter" in mixtral_repr
    qwen2_moe_repr = ranks[0]["qwen2-moe"]["repr"]
    # The shared expert is an MLP pair; its gate has one output, too narrow to share: every device computes it.
    assert "(shared_expert_gate): Linear(in_features=32, out_features=1" in qwen2_moe_repr
    assert "(shared_expert): Qwen2MoeMLP(\n            (gate_proj): ColumnParallelLinear" in qwen2_moe_repr
    qwen3_moe_repr = ranks[0]["qwen3-moe"]["repr"]
    assert "(q_norm): Qwen3MoeRMSNorm" in qwen3_moe_repr and "(q_proj): ColumnParallelLinear" in qwen3_moe_repr


def heads_that_do_not_divide() -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    import epl

    epl.init()
    config = LlamaConfig(
        vocab_size=VOCABULARY, hidden_size=24, intermediate_size=32, num_hidden_layers=1, num_attention_heads=3
    )
    with epl.split(2):
        model = LlamaForCausalLM(config)
    try:
        epl.parallelize(model, optimizer=adamw, loss_fn=next_token_loss)
    except epl.AnnotationError as error:
        return str(error)
    return "no error"


@pytest.mark.timeout(120)
def test_heads_that_do_not_divide_are_a_clear_error() -> None:
    for message in run_ranks(heads_that_do_not_divide, 2, timeout=90):
        assert "3 attention heads of 8 features each cannot be shared equally by 2 devices" in message


def dropout_runs() -> dict[str, Any]:
    """GPT-2 with every dropout on, trained twice from the same seed; each rank's replicated norm and RNG states."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import epl

    results = []
    for _ in range(2):
        epl.init()
        torch.manual_seed(0)
        config = GPT2Config(vocab_size=VOCABULARY, n_positions=32, n_embd=32, n_layer=LAYERS, n_head=4)
        config.bos_token_id = config.eos_token_id = 0
        with epl.split(2):
            model = GPT2LMHeadModel(config).double()
        engine = epl.parallelize(model, optimizer=adamw, loss_fn=next_token_loss)
        losses = [float(engine.step(tokens, tokens)) for tokens in batches()[:2]]
        (group,) = engine.context.shard_groups.values()
        results.append(
            {
                "losses": losses,
                "norm": engine.model.transformer.h[0].ln_2.weight.detach().clone(),
                "region_state": group.random.state.clone(),
            }
        )
        epl.Env.get().close()
    return {"runs": results}


@pytest.mark.timeout(200)
def test_dropout_is_reproducible_and_replicated_activations_stay_identical() -> None:
    first, second = (result["runs"] for result in run_ranks(dropout_runs, 2, timeout=180))
    # Reproducible: the same seed gives the same losses.
    for rank in (first, second):
        assert rank[0]["losses"] == rank[1]["losses"]
    # Replicated activations (and so the gradients of the norms every device holds) are identical on both devices.
    assert torch.equal(first[0]["norm"], second[0]["norm"])
    # Inside the regions each device draws from its own state.
    assert not torch.equal(first[0]["region_state"], second[0]["region_state"])


MAX_GRAD_NORM = 0.5


def llama_replicas_with_zero() -> dict[str, Any]:
    """Llama under split(2) on 4 processes (2 replicas), ZeRO v1, clipping on: each replica trains on its rows."""
    import epl

    epl.init(epl.Config({"zero.level": "v1", "optimizer.max_grad_norm": MAX_GRAD_NORM}))
    with epl.split(2):
        model = built("llama")
    engine = epl.parallelize(model, optimizer=adamw, loss_fn=next_token_loss)
    losses, norms = [], []
    for tokens in batches():
        share = BATCH // engine.num_replicas
        rows = tokens[share * engine.replica_index : share * (engine.replica_index + 1)]
        losses.append(float(engine.step(rows, rows)))
        norms.append(engine.grad_norm)
    state = engine.state_dict(full=True)["model"]
    return {"replica": engine.replica_index, "losses": losses, "norms": norms, "state": state}


def clipped_replicas_locally(
    replicas: int, *, after_average: bool = False
) -> tuple[list[list[float]], list[list[float]], dict[str, torch.Tensor]]:
    """The reference: each replica's rows' gradient clipped on its own (clipping before the all-reduce, EPL's
    default), then averaged, one AdamW step; ``after_average``: the average clipped by its norm instead (ZeRO, and
    ``communication.clip_after_allreduce``). Returns each replica's losses and norms, and the final state."""
    model = built("llama")
    optimizer = adamw(model.parameters())
    losses: list[list[float]] = [[] for _ in range(replicas)]
    norms: list[list[float]] = [[] for _ in range(replicas)]
    for tokens in batches():
        total = [torch.zeros_like(p) for p in model.parameters()]
        for replica, rows in enumerate(tokens.chunk(replicas)):
            model.zero_grad()
            loss = next_token_loss(model(rows), rows)
            loss.backward()
            if not after_average:
                norms[replica].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)))
            losses[replica].append(float(loss))
            for sum_, p in zip(total, model.parameters(), strict=True):
                sum_ += p.grad / replicas
        for p, grad in zip(model.parameters(), total, strict=True):
            p.grad = grad
        if after_average:
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM))
            for replica in range(replicas):
                norms[replica].append(norm)
        optimizer.step()
    return losses, norms, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(300)
def test_split_with_replicas_zero_and_clipping_equals_the_local_run() -> None:
    """ZeRO reduces the gradients inside the backward: the average is clipped, by its own norm."""
    results = run_ranks(llama_replicas_with_zero, 4, timeout=240)
    losses, norms, state = clipped_replicas_locally(2, after_average=True)
    assert sorted(r["replica"] for r in results) == [0, 0, 1, 1]
    assert norms[0][0] > MAX_GRAD_NORM  # clipping acts
    for result in results:
        replica = result["replica"]
        torch.testing.assert_close(result["losses"], losses[replica], rtol=TOLERANCE, atol=TOLERANCE)
        torch.testing.assert_close(result["norms"], norms[replica], rtol=TOLERANCE, atol=TOLERANCE)
        for name, value in result["state"].items():
            torch.testing.assert_close(value, state[name], rtol=TOLERANCE, atol=TOLERANCE, msg=name)
