"""A split that shards almost nothing says so: a warning at ``epl.parallelize`` names the modules kept whole."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.multiprocess


class Projection(nn.Module):
    """A linear-like module of its own type (a 2-D weight and a bias): sharded only inside a column/row pair."""

    def __init__(self, features: int, out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(features, out) / features**0.5)
        self.bias = nn.Parameter(torch.zeros(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


def warnings_of(linear: type[nn.Module]) -> list[str]:
    """The warnings of a split of two ``linear`` layers with a norm over their features between them (no pair)."""
    import epl

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("epl").addHandler(Keep(logging.WARNING))
    epl.init()
    torch.manual_seed(0)
    with epl.split(2):
        model = nn.Sequential(linear(16, 64), nn.LayerNorm(64), linear(64, 16))
    engine = epl.parallelize(
        model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.MSELoss(), example_inputs=torch.ones(4, 16)
    )
    engine.step(torch.ones(4, 16), torch.zeros(4, 16))
    return records


def warnings_at_parallelize() -> list[str]:
    """Two projections with a norm over their features between them: no pair, so both are kept whole."""
    return warnings_of(Projection)


@pytest.mark.timeout(120)
def test_a_split_that_keeps_most_parameters_whole_names_them_and_why() -> None:
    for records in run_ranks(warnings_at_parallelize, 2, timeout=100):
        (message,) = [r for r in records if "keeps" in r]
        assert "taskgraph_0 (split(2)) keeps 100% of its parameters whole on every device" in message
        assert "0 (1,088 elements: a whole operand spans the sharded dimension (in 1: layer_norm))" in message
        assert "2 (1,040 elements: a linear-like layer in no column/row pair)" in message
        assert "register a split rule" in message


def unpaired_warnings() -> list[str]:
    """Two nn.Linear with a norm over their features between them: each sharded with its output gathered."""
    return warnings_of(nn.Linear)


@pytest.mark.timeout(120)
def test_a_split_with_more_collectives_than_megatrons_names_what_broke_the_pairing() -> None:
    for records in run_ranks(unpaired_warnings, 2, timeout=100):
        (message,) = [r for r in records if "more collectives" in r]
        assert "taskgraph_0 (split(2)) issues more collectives than Megatron's pairing of the same layers" in message
        assert "What broke the pairing: 0 (a whole operand spans the sharded dimension (in 1: layer_norm))" in message
