"""A whole parameter applied to sharded activations (a norm over each attention head, as Qwen3's ``q_norm``).

Inside a column/row region each device holds some heads, so the norm's weight, which
every device keeps whole, gets from each device the gradient of its heads only. EPL
sums it over the devices with one all-reduce per backward; when the devices also split
the batch (colocated with ``replicate``), the gradient reduction that averages whole
parameters over them already does, and no all-reduce is added. A weight used both on
the sharded heads and elsewhere would need both at once: the region is not formed and
its layers keep whole outputs. Each case
trains 3 Adam steps on 2 processes, equal to the one-process run in float64 to 1e-10.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers.distributed import run_ranks
from tests.helpers.reference import assert_rank_matches, train_locally

pytestmark = pytest.mark.multiprocess

DIM, HEADS, ROWS, STEPS = 16, 4, 8, 3
TOLERANCE = 1e-10


class HeadNorm(nn.Module):
    """RMS norm over each head's features, one weight for every head."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, head_dim))

    def forward(self, heads: torch.Tensor) -> torch.Tensor:
        return heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class HeadNormBlock(nn.Module):
    """``x + down(norm(up(x) as heads))``; ``norm_input_too`` also applies the norm to ``x`` as heads."""

    def __init__(self, *, norm_input_too: bool = False) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, DIM)
        self.norm = HeadNorm(DIM // HEADS)
        self.down = nn.Linear(DIM, DIM)
        self.norm_input_too = norm_input_too

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        h = self.norm(h.view(*h.shape[:-1], -1, DIM // HEADS)).flatten(-2)
        if self.norm_input_too:
            x = self.norm(x.view(*x.shape[:-1], -1, DIM // HEADS)).flatten(-2)
        return x + self.down(h)


def build(kind: str) -> nn.Module:
    import epl

    torch.manual_seed(0)
    if kind == "colocated":
        with epl.replicate(2, name="embedding"):
            embedding = nn.Linear(DIM, DIM)
        with epl.split(2, name="block"):
            block = HeadNormBlock()
        return nn.Sequential(embedding, block).double()
    with epl.split(2, name="block"):
        return HeadNormBlock(norm_input_too=kind == "outside too").double()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(4)
    return [
        (
            torch.randn(ROWS, 3, DIM, generator=generator, dtype=torch.float64),
            torch.randn(ROWS, 3, DIM, generator=generator, dtype=torch.float64),
        )
        for _ in range(STEPS)
    ]


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def train(kind: str) -> dict[str, Any]:
    import epl

    config = {"cluster.colocate_split_and_replicate": True} if kind == "colocated" else {}
    epl.init(epl.Config(config))
    engine = epl.parallelize(build(kind), optimizer=adam, loss_fn=nn.MSELoss())
    losses = [float(engine.step(x, y)) for x, y in batches()]
    (group,) = engine.context.shard_groups.values()
    return {
        "losses": losses,
        "state": engine.state_dict(full=True)["model"],
        "repr": repr(engine.model),
        "all_reduces": group.collectives["all_reduce"],
    }


def reference(kind: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    import epl

    epl.init()
    model = build(kind)
    return train_locally(model, adam(model.parameters()), batches(), 1, nn.MSELoss())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["split", "colocated"])
def test_norm_over_sharded_heads_gets_the_gradient_of_every_head(kind: str) -> None:
    losses, state = reference(kind)
    for result in run_ranks(train, 2, kind, timeout=100):
        # Per step, split: the row's output forward and the norm's gradient backward (the input needs no gradient);
        # colocated: rows are gathered and reduce-scattered instead, and the norm needs no all-reduce of its own.
        assert result["all_reduces"] == STEPS * (2 if kind == "split" else 0)
        assert "(up): ColumnParallelLinear" in result["repr"] and "role=column" in result["repr"]
        assert "(down): RowParallelLinear" in result["repr"]
        assert_rank_matches(result, losses, state, TOLERANCE)


@pytest.mark.timeout(120)
def test_norm_used_on_sharded_heads_and_elsewhere_keeps_the_layers_whole() -> None:
    losses, state = reference("outside too")
    for result in run_ranks(train, 2, "outside too", timeout=100):
        assert "role=alone" in result["repr"] and "RowParallelLinear" not in result["repr"]
        assert_rank_matches(result, losses, state, TOLERANCE)
