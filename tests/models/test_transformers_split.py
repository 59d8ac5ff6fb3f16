"""transformers' models, unmodified, under one ``epl.split(2)`` scope, equal the local run.

Llama (grouped-query attention, RMSNorm, rotary embeddings, SwiGLU), GPT-2 (Conv1D,
fused q/k/v ``c_attn``, LM head tied to the embedding), BERT (embeddings with buffers,
a classification head), Mixtral (router and fused experts: expert parallel) and a
Llama written by hand the torchtitan way (:mod:`tests.models.handwritten_llama`): tiny
configs, random weights, nothing downloaded, float64. Each trains 4 AdamW steps on 2
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


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCABULARY,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


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

    config = MixtralConfig(
        vocab_size=VOCABULARY,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    return MixtralForCausalLM(config)


def torchtitan_llama() -> nn.Module:
    return handwritten_llama.Transformer(
        handwritten_llama.ModelArgs(dim=32, n_layers=LAYERS, n_heads=4, n_kv_heads=2, vocab_size=VOCABULARY)
    )


MODELS: dict[str, Callable[[], nn.Module]] = {
    "llama": llama,
    "gpt2": gpt2,
    "bert": bert,
    "mixtral": mixtral,
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
