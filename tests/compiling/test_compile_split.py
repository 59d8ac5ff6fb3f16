"""A split transformers Llama compiled: its collectives are traced as torch's functional collectives, so each block
compiles to one forward graph and one backward graph (no break at the collectives), and trains as the same script
eager in one process.

The backend here is ``aot_eager`` (AOTAutograd, no generated code); ``engine.compile_report`` counts the forward and
backward graphs AOTAutograd made of each block type. In float64 the losses and every parameter after 3 AdamW steps
equal eager's to 1e-10, under split(2), split(2) with checkpointing (its recomputation inside the backward graph),
split(2) with ``split.sequence_parallel``, and split(2) x 2 pipeline stages (4 processes). Inductor in float32:
``nox -s compile`` (``tests/compiling/test_compile_layouts.py`` with ``EPL_COMPILE_BACKEND=inductor``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.compiling.test_compile_layouts import LAYOUTS, TOLERANCE, train
from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.multiprocess


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "name", ["split(2)", "split(2), checkpointing", "split(2), sequence parallel", "split(2) x 2 stages"]
)
def test_a_split_block_compiles_to_one_graph_each_way_and_trains_as_eager(name: str) -> None:
    expected = train(None, None, torch.float64)
    tolerance = TOLERANCE[torch.float64]
    for rank, found in enumerate(run_ranks(train, LAYOUTS[name][2], name, "aot_eager", torch.float64, timeout=280)):
        compiled, graphs, eager = found["report"]
        assert compiled and not eager, (rank, found["report"])
        assert graphs == {"LlamaDecoderLayer": 1}, (rank, graphs)  # no graph break at split's collectives
        one = {"LlamaDecoderLayer": 1}
        assert found["directions"] == (one, one), (rank, found["directions"])  # 1 forward graph, 1 backward graph
        torch.testing.assert_close(found["losses"], expected["losses"], rtol=tolerance, atol=tolerance)
        for key, value in found["state"].items():
            torch.testing.assert_close(value, expected["state"][key], rtol=tolerance, atol=tolerance, msg=key)


class Dropping(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(self.linear(x), p=0.1, training=self.training)


def test_a_split_block_that_draws_random_numbers_is_refused() -> None:
    """A split region draws from its own random state per device, which a compiled block cannot switch to."""
    import torch._dynamo

    from epl.compiling import compile_blocks
    from epl.compiling.compiled import draws_random

    torch._dynamo.reset()
    blocks = [("0", Dropping()), ("1", Dropping())]
    compile_blocks(blocks, "aot_eager", refuse_random=True)
    with pytest.raises(Exception, match="draws random numbers .*dropout.* Set the model's dropout to 0"):
        blocks[0][1](torch.randn(2, 4))
    graph = torch.fx.symbolic_trace(Dropping().eval())
    assert draws_random(graph) is None  # training False: dropout draws nothing
    assert draws_random(torch.fx.symbolic_trace(Dropping())) == "dropout"
