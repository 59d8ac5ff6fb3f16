"""Stages from models that are not nn.Sequential: tuples, dicts and a skip connection across stages."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers.distributed import run_ranks
from tests.helpers.reference import assert_rank_matches, train_locally

MICRO, BATCH, STEPS = 4, 8, 3


class Embed(nn.Module):
    """Stage 0: returns a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.gate = nn.Linear(6, 8), nn.Linear(6, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x).tanh(), self.gate(x).sigmoid()


class Middle(nn.Module):
    """Stage 1: takes the tuple whole, returns a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        h, gate = pair
        return {"h": self.lin(h * gate).relu(), "gate": gate}


class Head(nn.Module):
    """Stage 2: takes the dict whole and a skip connection from stage 0."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, values: dict[str, torch.Tensor], skip: torch.Tensor) -> torch.Tensor:
        return self.lin(values["h"] + values["gate"] * skip)


class Branchy(nn.Module):
    """A forward that passes a tuple, a dict and a skip connection from stage 0 to stage 2."""

    def __init__(self) -> None:
        import epl

        super().__init__()
        with epl.replicate(device_count=1, name="embed"):
            self.embed = Embed()
        with epl.replicate(device_count=1, name="middle"):
            self.middle = Middle()
        with epl.replicate(device_count=1, name="head"):
            self.head = Head()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pair = self.embed(x)
        skip = pair[0] * 0.5  # computed on stage 0, used on stage 2
        return self.head(self.middle(pair), skip)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(5)
    return [
        (
            torch.randn(BATCH, 6, generator=generator, dtype=torch.float64),
            torch.randn(BATCH, 3, generator=generator, dtype=torch.float64),
        )
        for _ in range(STEPS)
    ]


def train(strategy: str) -> dict[str, Any]:
    import epl

    epl.init(epl.Config({"pipeline.num_micro_batch": MICRO, "pipeline.strategy": strategy}))
    torch.manual_seed(0)
    engine = epl.parallelize(
        Branchy().double(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), loss_fn=nn.MSELoss()
    )
    losses = [float(engine.step(x, y)) for x, y in batches()]
    return {"losses": losses, "state": {k: v.clone() for k, v in engine.model.state_dict().items()}}


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["PreferBackward", "ZeroBubble"])
def test_tuples_dicts_and_a_skip_connection_across_stages(strategy: str) -> None:
    import epl

    ranks = run_ranks(train, 3, strategy, timeout=180)
    epl.init()
    torch.manual_seed(0)
    model = Branchy().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    expected, full = train_locally(model, optimizer, batches(), MICRO)
    for stage, result in enumerate(ranks):
        assert_rank_matches(result, expected, full, 1e-12)
        assert {k.split(".")[0] for k in result["state"]} == {["embed", "middle", "head"][stage]}


def test_a_forward_that_branches_on_tensor_values_cannot_be_split() -> None:
    import epl
    from epl.errors import PlacementError
    from epl_pipeline.partition import trace_stages

    class Moody(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            return self.b(h) if h.sum() > 0 else h

    epl.init()
    with pytest.raises(PlacementError, match=r"Cannot split Moody into pipeline stages: torch.fx could not trace"):
        trace_stages(Moody(), {"a": 0, "b": 1}, 2, {})


def test_stages_called_out_of_order_are_named() -> None:
    from epl.errors import PlacementError
    from epl_pipeline.partition import trace_stages

    class Backwards(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(self.b(x))

    with pytest.raises(PlacementError, match=r"stage 0's module 'a' uses 'b', computed on the later stage 1"):
        trace_stages(Backwards(), {"a": 0, "b": 1}, 2, {})


def test_values_cross_every_stage_in_between() -> None:
    from epl_pipeline.partition import trace_stages

    class Skip(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            return self.c(self.b(h)) + h + x

    staged = trace_stages(Skip(), {"a": 0, "b": 1, "c": 2}, 3, {})
    assert [[n.name for n in boundary] for boundary in staged.boundaries] == [["x", "a"], ["x", "a", "b"]]
    assert [n.name for n in staged.nodes_of(2)] == ["c", "add", "add_1"]
