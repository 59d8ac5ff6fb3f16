"""A split transformers Llama compiled: its collectives are traced as torch's functional collectives, so each block
compiles to one forward graph and one backward graph (no break at the collectives), and trains as the same script
eager in one process.

The backend here is ``aot_eager``'s own (AOTAutograd, no generated code) with compilers that count the forward and
backward graphs it is given. In float64 the losses and every parameter after 3 AdamW steps equal eager's to 1e-10,
under split(2), split(2) with checkpointing (its recomputation inside the backward graph), split(2) with
``split.sequence_parallel``, and split(2) x 2 pipeline stages (4 processes). Inductor
in float32: ``nox -s compile`` (``tests/compiling/test_compile_layouts.py`` with ``EPL_COMPILE_BACKEND=inductor``).
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from torch import nn

from tests.compiling.test_compile_layouts import LAYOUTS, TOLERANCE, train
from tests.helpers.distributed import run_ranks

COUNTING = "epl_test_counting"
#: Graphs the counting backend's compilers were given on this process, by "forward"/"backward".
GRAPHS: collections.Counter[str] = collections.Counter()


def register_counting_backend() -> None:
    """``aot_eager`` with compilers that count the forward and backward graphs, as backend ``epl_test_counting``."""
    import torch._dynamo
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def counted(kind: str) -> Any:
        def compiler(graph: torch.fx.GraphModule, example_inputs: Any) -> Any:
            GRAPHS[kind] += 1
            return make_boxed_func(graph.forward)

        return compiler

    if COUNTING not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(aot_autograd(fw_compiler=counted("forward"), bw_compiler=counted("backward")),
                                       name=COUNTING)  # fmt: skip


def train_counted(name: str) -> dict[str, Any]:
    register_counting_backend()
    found = train(name, COUNTING, torch.float64)
    return {**found, "counted": dict(GRAPHS)}


pytestmark = pytest.mark.multiprocess


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "name", ["split(2)", "split(2), checkpointing", "split(2), sequence parallel", "split(2) x 2 stages"]
)
def test_a_split_block_compiles_to_one_graph_each_way_and_trains_as_eager(name: str) -> None:
    expected = train(None, None, torch.float64)
    tolerance = TOLERANCE[torch.float64]
    for rank, found in enumerate(run_ranks(train_counted, LAYOUTS[name][2], name, timeout=280)):
        compiled, graphs, eager = found["report"]
        assert compiled and not eager, (rank, found["report"])
        assert graphs == {"LlamaDecoderLayer": 1}, (rank, graphs)  # no graph break at split's collectives
        assert found["counted"] == {"forward": 1, "backward": 1}, (rank, found["counted"])
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
