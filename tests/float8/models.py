"""The tiny Llama the float8 tests train (random weights, nothing downloaded), its data and its loss."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

VOCABULARY, SEQUENCE, ROWS = 128, 32, 4


def llama(layers: int = 4, seed: int = 0) -> nn.Module:
    """A Llama with every linear's dimensions multiples of 16 (hidden 64, MLP 128, 4 heads, 2 key/value heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCABULARY,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def token_loss(outputs: Any, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each position's logits against the next token."""
    logits = outputs.logits
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def batches(steps: int, rows: int = ROWS, distinct: int = 4) -> list[torch.Tensor]:
    """``steps`` batches cycling over ``distinct`` fixed ones, so that the loss falls as the model learns them."""
    generator = torch.Generator().manual_seed(3)
    fixed = [torch.randint(0, VOCABULARY, (rows, SEQUENCE), generator=generator) for _ in range(distinct)]
    return [fixed[i % distinct] for i in range(steps)]


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0)
