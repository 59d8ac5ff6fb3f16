"""The proof sequence parallelism rests on: outside their attention and MLP, the blocks work token by token.

One process: the layout is decided from the example run as ``epl.split`` does, with ``sequence_parallel``.
transformers' Llama and GPT-2 pass; toy blocks that mix tokens, view the stream, add a whole tensor spanning
the sequence, or use a region's gathered input besides its column layers are refused, each saying what.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from epl.errors import AnnotationError
from epl.sharding.layout import decide_layout

HIDDEN, SEQUENCE = 8, 6


class MLP(nn.Module):
    def __init__(self, residual_inside: bool = False) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)
        self.residual_inside = residual_inside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(torch.relu(self.up(x)))
        return y + x if self.residual_inside else y


class Block(nn.Module):
    def __init__(self, variant: str) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.mlp = MLP(residual_inside=variant == "residual inside the MLP")
        self.position = nn.Parameter(torch.zeros(1, SEQUENCE, HIDDEN))
        self.variant = variant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mlp(self.norm(x))
        if self.variant == "cumsum":
            x = x.cumsum(1)
        elif self.variant == "whole position":
            x = x + self.position
        elif self.variant == "view":
            x = x.view(-1, HIDDEN).view(x.shape)
        elif self.variant == "mean over tokens":
            x = x - x.mean(1, keepdim=True)
        return x


class Toy(nn.Module):
    def __init__(self, variant: str = "plain") -> None:
        super().__init__()
        self.embed = nn.Embedding(16, HIDDEN)
        self.layers = nn.ModuleList(Block(variant) for _ in range(2))
        self.head = nn.Linear(HIDDEN, 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def decide(model: nn.Module, example: object = None) -> None:
    linears = {name for name, m in model.named_modules() if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"}
    embeddings = {name for name, m in model.named_modules() if isinstance(m, nn.Embedding)}
    decide_layout(
        model, linears, embeddings, loss_is_cross_entropy=True, has_loss=True, example=example, sequence_parallel=True
    )


def test_token_wise_blocks_pass() -> None:
    decide(Toy(), torch.arange(2 * SEQUENCE).remainder(16).reshape(2, SEQUENCE))


@pytest.mark.parametrize(
    ("variant", "said"),
    [
        ("cumsum", "cumsum in layers.0 is not known to work token by token"),
        ("whole position", "combines the tokens with a whole tensor of shape [1, 6, 8]"),
        ("view", "view in layers.0"),
        ("mean over tokens", "mean in layers.0 reduces over the tokens"),
        ("residual inside the MLP", "its input reaches add in layers.0.mlp besides its column layers"),
    ],
)
def test_blocks_that_mix_tokens_are_refused(variant: str, said: str) -> None:
    with pytest.raises(AnnotationError, match="split.sequence_parallel would run") as error:
        decide(Toy(variant), torch.arange(2 * SEQUENCE).remainder(16).reshape(2, SEQUENCE))
    assert said in str(error.value) and "set split.sequence_parallel to False" in str(error.value)


@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen2", "mistral"])
def test_transformers_decoders_pass(name: str) -> None:
    from tests.models import test_transformers_split as T

    decide(T.built(name))


def test_without_an_example_run_sequence_parallelism_is_refused() -> None:
    class NoExample(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(HIDDEN)  # no embedding or linear first: no example input is guessed
            self.layers = nn.ModuleList(MLP() for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers[1](self.layers[0](self.norm(x)))

    model = NoExample()
    with pytest.raises(AnnotationError, match="needs an example run of the model"):
        decide_layout(model, {"layers.0.up"}, set(), loss_is_cross_entropy=False, has_loss=True, sequence_parallel=True)
