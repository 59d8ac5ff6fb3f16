"""Gradient checkpointing: the same losses and parameters as without it, with fewer activations kept."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import epl
import epl_memory
from epl_memory.checkpointing import balanced_segments
from tests.helpers.distributed import run_ranks

STEPS = 3


class Block(nn.Module):
    """A pre-norm MLP block with dropout: random values that recomputation must reproduce."""

    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Dropout(dropout), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x + MLP(norm(x))."""
        return x + self.mlp(self.norm(x))


class Tower(nn.Module):
    """Four repeated blocks and a head."""

    def __init__(self, width: int = 16, dropout: float = 0.2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, dropout) for _ in range(4))
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The blocks in order, then the head."""
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 16, generator=generator, dtype=torch.float64), torch.randn(8, 3, generator=generator))
        for _ in range(STEPS)
    ]


def saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd keeps for backward after one forward (each storage once)."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()} | {x.untyped_storage().data_ptr()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum()
    return sum(size for pointer, size in storages.items() if pointer not in parameters)


def train(config: dict[str, Any], build: Any = Tower, mark: Any = None) -> dict[str, Any]:
    """Train 3 steps with ``config`` in this process (or on every rank of a launched job)."""
    env = epl.init(epl.Config(config))
    torch.manual_seed(0)
    model = build().double()
    if mark is not None:
        mark(model)
    engine = epl.parallelize(model, optimizer=lambda p: torch.optim.AdamW(p, lr=0.01), loss_fn=nn.MSELoss())
    losses = []
    for x, y in batches():
        share = x.shape[0] // engine.num_replicas
        rows = slice(engine.replica_index * share, (engine.replica_index + 1) * share)
        torch.manual_seed(10 + len(losses))  # dropout's stream, the same in every run
        losses.append(float(engine.step(x[rows], y[rows].double())))
    from epl_memory.checkpointing import CheckpointingState

    state = engine.context.state(CheckpointingState)
    check = state.check
    return {
        "losses": losses,
        "state": {k: v.clone() for k, v in engine.model.state_dict().items()},
        "saved": saved_bytes(engine.model, batches()[0][0]) if engine.plan.num_stages == 1 else None,
        "plan": state.plan.describe() if state.plan is not None else None,
        "modules": state.plan.modules if state.plan is not None else None,
        "check": dict(check.results) if check is not None else None,
        "rank": env.cluster.rank,
    }


def assert_same_training(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["losses"] == b["losses"]
    for key, value in a["state"].items():
        torch.testing.assert_close(value, b["state"][key], rtol=0, atol=0, msg=key)


def test_auto_checkpoints_the_repeated_blocks_and_trains_identically() -> None:
    plain = train({})
    auto = train({"gradient_checkpoint.type": "auto"})
    assert auto["plan"] == "4 modules"
    assert_same_training(auto, plain)  # dropout included: recomputation draws the same masks
    assert auto["saved"] < 0.5 * plain["saved"], (auto["saved"], plain["saved"])


def test_collection_checkpoints_the_marked_modules_only() -> None:
    def mark(model: Tower) -> None:
        epl_memory.checkpoint(model.blocks[1])
        epl_memory.checkpoint(model.blocks[2])

    plain = train({})
    marked = train({"gradient_checkpoint.type": "collection"}, mark=mark)
    everything = train({"gradient_checkpoint.type": "auto"})
    assert marked["plan"] == "2 modules"
    assert_same_training(marked, plain)
    assert everything["saved"] < marked["saved"] < plain["saved"]


def test_auto_on_a_sequential_uses_about_sqrt_n_balanced_segments() -> None:
    layers = nn.Sequential(*[nn.Linear(16, 16) if i % 2 == 0 else nn.Tanh() for i in range(9)])
    segments = balanced_segments(layers)
    assert len(segments) == 3 and [i for s in segments for i in s] == list(range(9))

    def build() -> nn.Module:
        return nn.Sequential(*[nn.Linear(16, 16) if i % 2 == 0 else nn.Tanh() for i in range(8)], nn.Linear(16, 3))

    plain = train({}, build=build)
    auto = train({"gradient_checkpoint.type": "auto"}, build=build)
    assert auto["plan"] == "model: 3 segments"
    assert_same_training(auto, plain)
    assert auto["saved"] < plain["saved"]


def test_end_taskgraph_limits_checkpointing_to_the_first_taskgraphs() -> None:
    def build() -> nn.Module:
        with epl.replicate(1, name="first"):
            first = Tower()
        with epl.replicate(1, name="second"):
            second = Tower()
        return nn.Sequential(first, nn.Linear(3, 16), second)

    config = {"gradient_checkpoint.type": "collection", "gradient_checkpoint.end_taskgraph": 0}

    def mark(model: nn.Module) -> None:
        for block in [*model[0].blocks, *model[2].blocks]:
            epl_memory.checkpoint(block)

    result = train(config, build=build, mark=mark)
    assert result["plan"] == "4 modules"  # the second TaskGraph's four blocks are left alone


def test_check_gradients_reports_each_module_once() -> None:
    result = train({"gradient_checkpoint.type": "auto", "gradient_checkpoint.check_gradients": True})
    assert set(result["check"]) == {f"blocks.{i}" for i in range(4)}
    assert all(difference is not None and difference < 1e-12 for difference in result["check"].values())
    assert_same_training(result, train({}))


def test_with_data_parallel_and_with_a_pipeline_on_processes() -> None:
    """Without dropout (each process draws its own masks), both equal the local run."""
    plain = train({}, build=_deterministic)
    parallel = run_ranks(train, 2, {"gradient_checkpoint.type": "auto"}, _deterministic, timeout=120)
    for result in parallel:  # 2 replicas, each on half of the batch: the same update as the local run
        assert result["plan"] == "4 modules"
        torch.testing.assert_close(result["state"], plain["state"], rtol=1e-12, atol=1e-12)
    config = {"gradient_checkpoint.type": "auto", "pipeline.num_micro_batch": 2}
    staged = run_ranks(train, 2, config, _stages, timeout=120)
    local = train({"pipeline.num_micro_batch": 2}, build=_stages)
    for result in staged:
        assert result["losses"] == pytest.approx(local["losses"], abs=1e-12)
        for key, value in result["state"].items():
            torch.testing.assert_close(value, local["state"][key], rtol=1e-12, atol=1e-12)


def test_auto_checkpoints_the_repeated_blocks_of_each_pipeline_stage() -> None:
    """auto.auto_parallel cuts the list of blocks between stages: each stage checkpoints its own blocks (the
    list's other items are other stages' placeholders), and trains as the local run."""
    config = {
        "gradient_checkpoint.type": "auto",
        "pipeline.num_micro_batch": 2,
        "auto.auto_parallel": True,
        "pipeline.num_stages": 2,
    }
    staged = run_ranks(train, 2, config, _deterministic, timeout=120)
    assert [result["modules"] for result in staged] == [("blocks.0", "blocks.1"), ("blocks.2", "blocks.3")]
    local = train({"pipeline.num_micro_batch": 2}, build=_deterministic)
    for result in staged:
        assert result["losses"] == pytest.approx(local["losses"], abs=1e-12)
        for key, value in result["state"].items():
            torch.testing.assert_close(value, local["state"][key], rtol=1e-12, atol=1e-12)


def _deterministic() -> nn.Module:
    return Tower(dropout=0.0)


def _stages() -> nn.Module:
    with epl.replicate(1, name="stage_0"):
        first = Tower(dropout=0.0)
    with epl.replicate(1, name="stage_1"):
        second = nn.Sequential(nn.Linear(3, 16), Tower(dropout=0.0))
    return nn.Sequential(first, second)
