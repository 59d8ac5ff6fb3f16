"""Models built without memory for the tests of :mod:`epl.materialize`: transformers' (tiny configs, random
weights, nothing downloaded) and one written by hand the torch way (``reset_parameters`` on every module)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

VOCABULARY, SEQUENCE = 64, 8
DECODER: dict[str, Any] = {
    "vocab_size": VOCABULARY,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": SEQUENCE,
    "use_cache": False,
}


def llama(tied: bool = True) -> nn.Module:
    """A 4-layer Llama; ``tied``: the LM head is the embedding's weight."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**DECODER, tie_word_embeddings=tied))


def gpt2() -> nn.Module:
    """GPT-2 (Conv1D, fused q/k/v, a head tied to the embedding, c_proj scaled from its block's init)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCABULARY, n_positions=SEQUENCE, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def mixtral() -> nn.Module:
    """Mixtral: 4 experts, top-2 routing (the routing reads the weights' values), eager expert products."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        **DECODER, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False, experts_implementation="eager"
    )
    return MixtralForCausalLM(config)


class Scale(nn.Module):
    """A module with a parameter of its own and the ``reset_parameters`` that sets it."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.empty(features))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.gain, 0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class Block(nn.Module):
    def __init__(self, features: int) -> None:
        super().__init__()
        self.up = nn.Linear(features, 2 * features)
        self.down = nn.Linear(2 * features, features)
        self.scale = Scale(features)
        self.norm = nn.LayerNorm(features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale(self.down(torch.relu(self.up(self.norm(x)))))


class HandWritten(nn.Module):
    """Embedding, 4 blocks and a head, written the torch way: every module has ``reset_parameters``."""

    def __init__(self, features: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCABULARY, features)
        self.blocks = nn.ModuleList(Block(features) for _ in range(4))
        self.head = nn.Linear(features, VOCABULARY)
        self.register_buffer("temperature", torch.tensor(math.sqrt(features)))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x) / self.temperature


class Unset(nn.Module):
    """A parameter that no ``reset_parameters`` sets: a model built on meta cannot be given its values."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCABULARY, 8)
        self.bias = nn.Parameter(torch.zeros(8))
        self.head = nn.Linear(8, VOCABULARY)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens) + self.bias)


MODELS = {"llama": llama, "gpt2": gpt2, "mixtral": mixtral, "handwritten": HandWritten}
