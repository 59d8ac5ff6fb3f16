"""What goes wrong under ``epl.split`` says what and how to fix it; a third party's rule takes part."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import epl
from epl.plugins import hookimpl
from tests.helpers.distributed import run_ranks


class Scale(nn.Module):
    """A module type no built-in rule knows."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Multiply by the learned scale."""
        return x * self.scale


class Mixer(nn.Module):
    """A layer no rule covers, holding a matrix that is not a linear layer's ``weight``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.mixing = nn.Parameter(torch.eye(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Mix the features."""
        return x @ self.mixing


class ScaleRules:
    """A third party's plugin: keep ``Scale`` whole on every device (and count the calls)."""

    calls: list[str] = []

    @hookimpl
    def epl_split_rules(self) -> dict[type[nn.Module], Any]:
        """Register the rule for Scale."""
        return {Scale: self.keep_whole}

    def keep_whole(self, module: nn.Module, shard: epl.ShardContext) -> nn.Module:
        """Every device holds the whole module."""
        self.calls.append(f"{shard.name}:{shard.index}/{shard.count}")
        return module


def test_a_module_without_a_rule_fails_on_the_laptop_with_how_to_register_one() -> None:
    epl.init()
    with epl.split(2, name="head"):
        model = nn.Sequential(nn.Linear(4, 4), Mixer(4))
    with pytest.raises(epl.AnnotationError) as error:
        epl.parallelize(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    message = str(error.value)
    assert "head (split(2)) holds the module '1'" in message and "Mixer" in message
    assert "def epl_split_rules" in message and "outside the epl.split scope" in message


def test_a_bias_free_conv1d_is_not_taken_for_stacked_experts() -> None:
    """Its weight is [out_channels, in/groups, kernel] and ``out_channels`` names its first size (Bailing's
    hybrid layers): it gets the missing-rule error, not the fused-experts one."""
    epl.init()
    with epl.split(2, name="conv"):
        model = nn.Sequential(nn.Conv1d(8, 8, 4, groups=8, bias=False))
    with pytest.raises(epl.AnnotationError) as error:
        epl.parallelize(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    message = str(error.value)
    assert "no split rule says how to shard that type" in message and "Conv1d" in message
    assert "experts" not in message


def test_a_third_party_rule_is_used() -> None:
    epl.init()
    epl.Env.get().plugins.register(ScaleRules(), name="scale-rules")
    with epl.split(2):
        model = nn.Sequential(nn.Linear(4, 4), Scale(4))
    engine = epl.parallelize(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.MSELoss())
    assert float(engine.step(torch.randn(2, 4), torch.randn(2, 4))) > 0


def misuse() -> dict[str, str]:
    """On each rank, every misuse in turn; return the error each raised."""
    from epl.nn import Experts

    def attempt(config: dict[str, Any], build: Any, loss_fn: nn.Module | None = None) -> str:
        epl.init(epl.Config(config))
        try:
            epl.parallelize(build(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=loss_fn)
        except epl.EplError as exc:
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    def experts() -> nn.Module:
        with epl.split(2):
            return Experts(3, 4, 4)

    def embedding() -> nn.Module:
        with epl.split(2):
            return nn.Embedding(10, 4, sparse=True)

    return {"experts": attempt({}, experts), "embedding": attempt({}, embedding)}


@pytest.mark.multiprocess
def test_misuse_on_processes_gets_one_clear_error() -> None:
    errors = run_ranks(misuse, 2, timeout=120)
    assert errors[0] == errors[1]
    assert errors[0]["experts"].startswith("AnnotationError") and "3 experts" in errors[0]["experts"]
    assert "multiple of 2" in errors[0]["experts"]
    assert "sparse" in errors[0]["embedding"]


def test_tied_weights_under_split_are_accepted_on_the_laptop() -> None:
    """An LM head tied to the embedding: both shard the rows, so the tie holds (trained in tests/models)."""
    epl.init()
    with epl.split(2, name="lm"):
        embedding = nn.Embedding(10, 8)
        head = nn.Linear(8, 10, bias=False)
    head.weight = embedding.weight
    engine = epl.parallelize(nn.Sequential(embedding, head), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    assert engine.model[1].weight is engine.model[0].weight


def seeded_per_rank() -> dict[str, Any]:
    """Each rank seeds differently; the split model starts from the first device's values."""
    rank = int(__import__("os").environ["RANK"])
    epl.init()
    torch.manual_seed(100 + rank)
    with epl.split(2):
        model = nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 4))
    engine = epl.parallelize(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.MSELoss())
    whole = engine.state_dict(full=True)["model"]
    mine = engine.state_dict()
    swapped = {**mine, "shards": {key: [1 - index, count] for key, (index, count) in mine["shards"].items()}}
    try:
        engine.load_state_dict(swapped)
        refused = "no error"
    except epl.EplError as exc:
        refused = str(exc)
    split = [tg for tg in engine.context.taskgraphs if tg.strategy.kind == "split"][0]
    return {
        "whole": whole,
        "refused": refused,
        "only_shards_kept": all(id(t) in engine.context.split_tensors for t in split.tensors),
    }


@pytest.mark.multiprocess
def test_differently_seeded_devices_start_from_the_first_and_shards_do_not_cross_devices() -> None:
    results = run_ranks(seeded_per_rank, 2, timeout=120)
    torch.manual_seed(100)
    expected = nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 4)).state_dict()
    for result in results:
        for key, value in expected.items():
            torch.testing.assert_close(result["whole"][key], value, rtol=0, atol=0)
        assert "holds shard" in result["refused"] and "state_dict(full=True)" in result["refused"]
        assert result["only_shards_kept"]  # the whole tensors are not kept alive beside the shards


def refused_in_one_stage() -> str:
    """2 stages x split(2): a module no rule covers, in the first stage only."""
    epl.init(epl.Config({"pipeline.num_micro_batch": 2, "communication.timeout": 30}))
    with epl.split(2, name="stage_0"):
        first = nn.Sequential(nn.Linear(4, 4), Mixer(4))
    with epl.split(2, name="stage_1"):
        second = nn.Linear(4, 4)
    try:
        epl.parallelize(nn.Sequential(first, second), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    except epl.AnnotationError as error:
        return str(error)
    return "no error"


@pytest.mark.timeout(120)
def test_a_module_without_a_rule_in_one_stage_is_refused_by_every_rank() -> None:
    """The second stage's ranks refuse too, in the same phase: they do not go on into the pipeline's collectives
    to wait there for the first stage's ranks, which have left (and, in a process that goes on, pair those
    collectives with the next model's)."""
    for message in run_ranks(refused_in_one_stage, 4, timeout=90):
        assert "stage_0 (split(2)) holds the module '0.1'" in message and "Mixer" in message, message
