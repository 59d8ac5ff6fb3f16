"""Replayed stages (models fx cannot trace), in one process: the record, what travels, and the errors.

Each stage of a model is run the way a pipeline rank runs it (the other stages' root modules
replaced by placeholders), feeding each stage what the previous one returned; the last
stage's output must be the model's own.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from epl.errors import PlacementError
from epl_pipeline.channel import ShapeOnly
from epl_pipeline.replay import ReplayedStages, record_calls
from epl_pipeline.stages import RemoteStage, replace_module


class Untraceable(nn.Module):
    """Branches on a tensor value between its blocks (fx cannot trace it); a skip from ``a`` to ``c``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        first = self.a(x)
        if bool(first.sum() > -1e9):  # a data-dependent branch
            first = first * 2
        second = self.b(first.relu())
        return {"out": self.c(second) + first, "note": "kept"}


ROOTS = {"a": 0, "b": 1, "c": 2}


def run_stages(model: nn.Module, program: ReplayedStages, x: torch.Tensor) -> tuple[Any, list[list[Any]]]:
    """Each stage on its own copy of ``model`` (others' roots replaced), fed the previous stage's values."""
    received: list[Any] | None = None
    sent = []
    for stage in range(program.num_stages):
        mine = copy.deepcopy(model)
        for name, owner in ROOTS.items():
            if owner != stage:
                replace_module(mine, name, RemoteStage(name, owner, "Linear", torch.device("cpu")))
        result = program.run(mine, stage, x, received)
        if stage < program.num_stages - 1:
            sent.append(result)
            received = result
    return result, sent


def test_each_stage_sends_only_what_later_stages_read_and_the_last_returns_the_models_output() -> None:
    torch.manual_seed(0)
    model = Untraceable()
    x = torch.randn(3, 4)
    program = record_calls(model, ROOTS, 3, x)
    assert [(c.module, c.stage, c.last_reader) for c in program.calls] == [("a", 0, 2), ("b", 1, 2), ("c", 2, 2)]
    output, sent = run_stages(model, program, x)
    expected = model(x)
    torch.testing.assert_close(output["out"], expected["out"], rtol=0, atol=0)
    assert output["note"] == "kept"
    assert [len(values) for values in sent] == [1, 2]  # a's output to stage 1, then a's and b's to stage 2


def test_outputs_no_later_stage_reads_travel_as_shapes() -> None:
    """b only feeds c; a's output is read by b alone: stage 1 sends a's output on as its shape."""

    class Chain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 6), nn.Linear(6, 4), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c(self.b(self.a(x)))

    torch.manual_seed(0)
    model = Chain()
    x = torch.randn(3, 4)
    program = record_calls(model, ROOTS, 3, x)
    output, sent = run_stages(model, program, x)
    torch.testing.assert_close(output, model(x), rtol=0, atol=0)
    assert isinstance(sent[1][0], ShapeOnly) and sent[1][0].shape == (3, 6)
    assert isinstance(sent[1][1], torch.Tensor)


def test_stages_called_out_of_order_are_refused() -> None:
    with pytest.raises(PlacementError, match=r"calls 'b' \(stage 0\) after 'a' \(stage 1\)"):
        record_calls(Untraceable(), {"a": 1, "b": 0, "c": 1}, 2, torch.randn(3, 4))


def test_a_forward_that_calls_other_modules_than_the_example_run_is_refused() -> None:
    class Moody(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
            self.skip_b = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hidden = self.a(x)
            return self.c(hidden if self.skip_b else self.b(hidden))

    model = Moody()
    program = record_calls(model, {"a": 0, "b": 0, "c": 1}, 2, torch.randn(3, 4))
    model.skip_b = True
    replace_module(model, "c", RemoteStage("c", 1, "Linear", torch.device("cpu")))  # as on stage 0's rank
    with pytest.raises(PlacementError, match=r"called 'c' where the example run called 'b'"):
        program.run(model, 0, torch.randn(3, 4), None)


def test_a_model_without_an_example_to_record_from_asks_for_example_inputs() -> None:
    from epl_pipeline.program import stage_program

    class Convolutional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Conv2d(1, 2, 3), nn.Conv2d(2, 2, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hidden = self.a(x)
            if bool(hidden.sum() > 0):
                hidden = -hidden
            return self.b(hidden)

    model = Convolutional()
    with pytest.raises(PlacementError, match=r"(?s)torch.fx could not trace.*example_inputs=\.\.\."):
        stage_program(model, {"a": 0, "b": 1}, 2, {}, None)
    program = stage_program(model, {"a": 0, "b": 1}, 2, {}, torch.randn(1, 1, 8, 8))
    assert isinstance(program, ReplayedStages)


def test_split_points_are_checked() -> None:
    import epl
    from epl.errors import ConfigError

    class Blocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    epl.init(epl.Config({"pipeline.split_points": ["layers.2"]}))
    plan = epl.plan(Blocks(), world_size=2)
    assert [list(tg.modules) for tg in plan.taskgraphs] == [["layers.0", "layers.1"], ["layers.2", "layers.3"]]
    epl.init(epl.Config({"pipeline.split_points": ["layers.9"]}))
    with pytest.raises(PlacementError, match=r"\['layers.9'\] is not one"):
        epl.plan(Blocks(), world_size=2)
    epl.init(epl.Config({"pipeline.split_points": ["layers.3", "layers.1"]}))
    with pytest.raises(PlacementError, match=r"in the order forward calls them"):
        epl.plan(Blocks(), world_size=3)
    epl.init(epl.Config({"pipeline.split_points": ["layers.2"], "pipeline.num_stages": 3}))
    with pytest.raises(ConfigError, match=r"make 2 stages, but pipeline.num_stages is 3"):
        epl.plan(Blocks(), world_size=2)
