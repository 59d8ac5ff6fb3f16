"""Replayed stages pair one rank's module outputs with another's calls by their order: the orders must agree.

A forward that loops over a set of strings (transformers' Gemma 3 and OLMo 3 loop over
``set(config.layer_types)`` to compute a rotary embedding per layer type) orders it by the
strings' hashes, which differ between processes unless ``PYTHONHASHSEED`` is set: the later stage
would then use the other call's output, a wrong model with no error. ``epl.parallelize`` compares
the ranks' call orders and refuses; ``epl launch`` sets ``PYTHONHASHSEED=0`` for every rank.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.multiprocess


class Scaled(nn.Module):
    """A module called once per kind, as Gemma 3's rotary embedding is called once per layer type."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        return x * self.weight * (2.0 if kind == "full" else 0.5)


class KindsInRankOrder(nn.Module):
    """Calls ``scale`` per kind in an order that depends on the rank, as a set's order depends on the process."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = Scaled()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        kinds = ["full", "sliding"] if dist.get_rank() == 0 else ["sliding", "full"]
        if float(x.sum()) > -1e9:  # a branch on a value: torch.fx cannot trace it, so the stages are replayed
            scaled = {kind: self.scale(x, kind) for kind in kinds}
        return self.second(self.first(scaled["sliding"]) + scaled["full"])


def parallelize_pipeline() -> str:
    import epl

    epl.init(epl.Config({"pipeline.num_micro_batch": 2, "pipeline.split_points": ["second"]}))
    torch.manual_seed(0)
    model = KindsInRankOrder()
    try:
        epl.parallelize(
            model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.MSELoss(), example_inputs=torch.ones(2, 4)
        )
    except epl.PlacementError as error:
        return str(error)
    return "no error"


@pytest.mark.timeout(120)
def test_ranks_that_call_the_stage_modules_in_different_orders_are_refused() -> None:
    for message in run_ranks(parallelize_pipeline, 2, timeout=100):
        assert "calls its pipeline stage modules in an order that differs between ranks" in message
        assert "PYTHONHASHSEED=0" in message and "ranks [1] differ from rank 0" in message
