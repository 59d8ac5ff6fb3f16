"""The shape of a transformer that the planner's formulas need, read from a model built on meta or from numbers."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from epl.errors import EplError


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer: ``layers`` blocks of width ``hidden`` with ``heads`` query heads over
    ``kv_heads`` key/value heads, an MLP of ``ffn`` (``gated``: SwiGLU's gate and up), a vocabulary of ``vocab``;
    ``parameters`` all of them (the embedding and head included; ``tied``: one matrix for both)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    gated: bool = True
    tied: bool = False
    parameters: int = 0
    #: Tensors of the MLP's width the activation function saves for backward: 1 for torch's fused ones (SiLU,
    #: GELU), 4 for GPT-2's ``gelu_new`` written in Python (:func:`activation_saves`).
    activation_saves: float = 1.0

    def __post_init__(self) -> None:
        if self.parameters == 0:
            object.__setattr__(self, "parameters", self.layer_parameters() * self.layers + self.embedding_parameters())

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.heads

    def layer_parameters(self) -> int:
        """Weights of one block (attention, MLP, two norms)."""
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        attention = 2 * self.hidden * self.hidden + kv
        mlp = (3 if self.gated else 2) * self.hidden * self.ffn
        return attention + mlp + 2 * self.hidden

    def embedding_parameters(self) -> int:
        """The embedding, and the head unless tied."""
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @classmethod
    def of(cls, model: nn.Module) -> ModelShape:
        """The shape of a transformers causal LM from its ``config`` (its parameters counted from the model)."""
        config = getattr(model, "config", None)
        if config is None:
            raise EplError(
                "The planner's activation and time estimates need a transformer's shape: the model has no `config` "
                "(a transformers model has one). Plan with the memory estimate alone (no --device), or build a "
                "transformers model."
            )
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        experts = next((getattr(text, name) for name in _EXPERT_COUNTS if getattr(text, name, None)), None)
        if isinstance(experts, int) and experts > 1:
            raise EplError(
                f"The planner's formulas are for dense transformers; {type(model).__name__} routes tokens to "
                f"{experts} experts, whose weights, traffic and time it does not count yet. Plan with the memory "
                "estimate alone (no --device), or lay the model out by hand (docs/split.md covers experts)."
            )
        get = _getter(text)
        hidden = get("hidden_size", "n_embd", "d_model")
        heads = get("num_attention_heads", "n_head")
        names = {name for name, _ in model.named_modules()}
        return cls(
            layers=get("num_hidden_layers", "n_layer"),
            hidden=hidden,
            heads=heads,
            kv_heads=get("num_key_value_heads", default=heads),
            ffn=get("intermediate_size", "n_inner", default=4 * hidden) or 4 * hidden,
            vocab=get("vocab_size"),
            gated=any(name.endswith("gate_proj") for name in names),
            tied=bool(getattr(text, "tie_word_embeddings", False)),
            parameters=sum(p.numel() for p in model.parameters()),
            activation_saves=activation_saves(get_name(text, "hidden_act", "activation_function")),
        )


#: Config attributes transformers' mixture-of-experts models give their expert count in.
_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


@functools.cache
def activation_saves(name: str | None) -> float:
    """How many tensors of its input's size transformers' activation ``name`` saves for backward, measured once on
    a small input (1.0 when unknown)."""
    if not isinstance(name, str):
        return 1.0
    try:
        from transformers.activations import ACT2FN

        function = ACT2FN[name]
    except (ImportError, KeyError):
        return 1.0
    from epl.runtime.activations import SavedActivations

    x = torch.randn(8, 64, requires_grad=True)
    inner = x * 1.0
    meter = SavedActivations(exclude=[x])
    with meter:
        function(inner)
    return max(1.0, meter.peak / (inner.numel() * inner.element_size()))


def get_name(config: Any, *names: str) -> str | None:
    """The first of ``names`` the config sets (a string), or None."""
    return next((value for name in names if isinstance(value := getattr(config, name, None), str)), None)


def _getter(config: Any) -> Any:
    def get(*names: str, default: Any = None) -> Any:
        for name in names:
            value = getattr(config, name, None)
            if value is not None:
                return int(value)
        if default is not None:
            return default
        raise EplError(f"The model's config has none of {names}: the planner cannot read its shape.")

    return get
