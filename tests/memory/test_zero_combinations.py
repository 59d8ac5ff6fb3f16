"""ZeRO v1/v2 (on FSDP2) with the rest of EPL: pipelines, gradient checkpointing, accumulation, AMP, tied and
sparse parameters, the communication keys, checkpoints; and its errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import epl
from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.multiprocess


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def tower() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), Block(16), Block(16), nn.Linear(16, 3)).double()


def two_stages() -> nn.Module:
    torch.manual_seed(0)
    with epl.replicate(1, name="stage_0"):
        first = nn.Sequential(nn.Linear(6, 16), Block(16))
    with epl.replicate(1, name="stage_1"):
        second = nn.Sequential(Block(16), nn.Linear(16, 3))
    return nn.Sequential(first, second).double()


class Body(nn.Module):
    """Stage roots below a module that is not a container (the runner calls them, never the body)."""

    def __init__(self) -> None:
        super().__init__()
        with epl.replicate(1, name="stage_0"):
            self.first = nn.Sequential(nn.Linear(6, 16), Block(16))
        with epl.replicate(1, name="stage_1"):
            self.second = nn.Sequential(Block(16), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


class Root(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = Body()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def nested_stages() -> nn.Module:
    torch.manual_seed(0)
    return Root().double()


class SparseLookup(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 6, sparse=True)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = (x.abs() * 10).long().clamp(max=9)[:, :2]  # rows 0..9; some rows unused on a device
        return self.head(self.embedding(ids).mean(1))


def sparse_lookup() -> nn.Module:
    torch.manual_seed(0)
    return SparseLookup().double()


def batches(replicas: int, index: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    share = 8 // replicas
    rows = slice(share * index, share * (index + 1))
    result = []
    for _ in range(3):
        x = torch.randn(8, 6, generator=generator, dtype=torch.float64)
        y = torch.randn(8, 3, generator=generator, dtype=torch.float64)
        result.append((x[rows], y[rows]))
    return result


def train(config: dict[str, Any], build: Any = tower) -> dict[str, Any]:
    epl.init(epl.Config(config))
    sparse = build is sparse_lookup
    optimizer = (lambda p: torch.optim.SGD(p, lr=0.1)) if sparse else (lambda p: torch.optim.AdamW(p, lr=0.01))
    model = build()
    dtype = next(model.parameters()).dtype
    engine = epl.parallelize(model, optimizer=optimizer, loss_fn=nn.MSELoss())
    data = [(x.to(dtype), y.to(dtype)) for x, y in batches(engine.num_replicas, engine.replica_index)]
    if config.get("amp.level"):  # a step whose gradients overflow: skipped by every device
        data.insert(1, (torch.full_like(data[0][0], 3e38), data[0][1]))
    losses = [float(engine.step(x, y)) for x, y in data]
    x = data[0][0]
    prediction = engine.predict(x) if engine.plan.num_stages == 1 else None
    scaler = engine.loss_scaler
    return {
        "losses": losses,
        "state": engine.state_dict(full=True)["model"],
        "prediction": prediction,
        "scale": None if scaler is None else (scaler.scale, scaler.skipped_steps),
    }


def plain_and_zero(config: dict[str, Any], build: Any) -> dict[str, Any]:
    return {level: train({**config, "zero.level": level}, build) for level in ("", "v1", "v2")}


def assert_zero_equals_plain(results: list[dict[str, Any]], tolerance: float = 0.0) -> None:
    """Two copies of each parameter: every sum is of two numbers, so ZeRO is bit for bit plain DP (``tolerance``:
    relative, where the two reduce in another precision)."""
    for result in results:
        for level in ("v1", "v2"):
            if tolerance:
                assert result[level]["losses"] == pytest.approx(result[""]["losses"], rel=tolerance), level
            else:
                assert repr(result[level]["losses"]) == repr(result[""]["losses"]), level  # nan (a skipped step) too
            for key, value in result[""]["state"].items():
                torch.testing.assert_close(result[level]["state"][key], value, rtol=tolerance, atol=tolerance)
            if result[""]["prediction"] is not None:
                torch.testing.assert_close(result[level]["prediction"], result[""]["prediction"], rtol=tolerance,
                                           atol=tolerance)  # fmt: skip
            assert result[level]["scale"] == result[""]["scale"]


#: ZeRO reduce-scatters each micro-batch's gradient and sums the chunks (as FSDP2 and torchtitan do), where plain
#: data parallelism sums the micro-batches first and reduces once: the same sums in another order.
ACCUMULATED = 1e-12


def test_with_gradient_checkpointing_and_accumulation() -> None:
    config = {"gradient_checkpoint.type": "auto", "pipeline.num_micro_batch": 2}
    assert_zero_equals_plain(run_ranks(plain_and_zero, 2, config, tower, timeout=180), tolerance=ACCUMULATED)


def communication_keys() -> list[dict[str, Any]]:
    exact = {
        "communication.num_communicators": 2,
        "communication.max_splits": 3,
        "communication.gradients_reduce_method": "sum",
    }
    return [plain_and_zero(exact, tower), plain_and_zero({"communication.fp16": True}, tower)]


def test_with_the_communication_keys() -> None:
    """Two communicators, more buckets and the sum instead of the mean change nothing; fp16 on the wire reduces
    ZeRO's chunks in float16 (FSDP2's reduce_dtype, without EPL's fixed pre-scaling): equal to float16's precision."""
    exact, fp16 = zip(*run_ranks(communication_keys, 2, timeout=180), strict=True)
    assert_zero_equals_plain(list(exact))
    assert_zero_equals_plain(list(fp16), tolerance=2e-3)


def float32_tower() -> nn.Module:
    return tower().float()


def test_with_amp_and_a_skipped_step() -> None:
    """bfloat16 autocast, dynamic loss scale; an overflowing step is skipped on every device alike."""
    results = run_ranks(plain_and_zero, 2, {"amp.level": "O1"}, float32_tower, timeout=180)
    assert_zero_equals_plain(results)
    assert all(result["v2"]["scale"] == (2.0**14, 1) for result in results)


class TiedLookup(nn.Module):
    """The output layer's weight is the embedding's: two blocks use one parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 6)
        self.mix = nn.Linear(6, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = (x.abs() * 10).long().clamp(max=9)[:, 0]
        return self.head(torch.tanh(self.mix(self.embedding(ids))))[:, :3]


def tied_lookup() -> nn.Module:
    torch.manual_seed(0)
    return TiedLookup().double()


def test_with_tied_weights() -> None:
    """A parameter two blocks use belongs to the block above both (here the model): whole for the whole step."""
    assert_zero_equals_plain(run_ranks(plain_and_zero, 2, {}, tied_lookup, timeout=180))


def test_with_sparse_gradients() -> None:
    assert_zero_equals_plain(run_ranks(plain_and_zero, 2, {}, sparse_lookup, timeout=180))


def pipelines(config: dict[str, Any]) -> list[dict[str, Any]]:
    return [plain_and_zero(config, build) for build in (two_stages, nested_stages)]


def test_with_a_pipeline_of_two_stages_and_two_replicas() -> None:
    """Stage roots as items of the root, and below a module the runner never calls."""
    config = {"pipeline.num_micro_batch": 2, "gradient_checkpoint.type": "auto"}
    for results in zip(*run_ranks(pipelines, 4, config, timeout=300), strict=True):
        assert_zero_equals_plain(list(results), tolerance=ACCUMULATED)


def save_and_resume(directory: str) -> dict[str, Any]:
    """Two steps, save, a fresh engine loads the files, one more step: as if it had never stopped."""
    config = epl.Config({"zero.level": "v2"})
    epl.init(config)
    engine = epl.parallelize(tower(), optimizer=lambda p: torch.optim.Adam(p, lr=0.01), loss_fn=nn.MSELoss())
    data = batches(engine.num_replicas, engine.replica_index)
    for x, y in data[:2]:
        engine.step(x, y)
    path = Path(directory) / "checkpoint"
    engine.save(path)
    whole = engine.state_dict(full=True)["model"]
    engine.step(*data[2])
    straight = engine.state_dict(full=True)["model"]
    epl.init(config)
    resumed = epl.parallelize(tower(), optimizer=lambda p: torch.optim.Adam(p, lr=0.01), loss_fn=nn.MSELoss())
    resumed.load(path)
    resumed.step(*data[2])
    reader = dcp.FileSystemReader(str(path))
    keys = reader.read_metadata().state_dict_metadata
    saved = {key: torch.empty(keys[f"model/{key}"].size, dtype=torch.float64) for key in whole}
    dcp.load({f"model/{key}": value for key, value in saved.items()}, storage_reader=reader, no_dist=True)
    return {"straight": straight, "resumed": resumed.state_dict(full=True)["model"], "saved": saved, "whole": whole}


def test_v2_checkpoints_hold_whole_tensors_and_resume(tmp_path: Path) -> None:
    """Each rank writes its chunks of the whole tensors (read back whole by one process), and a resumed engine
    steps as if it had never stopped."""
    for result in run_ranks(save_and_resume, 2, str(tmp_path), timeout=120):
        for key, value in result["whole"].items():
            assert torch.equal(result["saved"][key], value), key
        for key, value in result["straight"].items():
            assert torch.equal(result["resumed"][key], value), key


class ReadsAnotherBlocksWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.nn.functional.linear(x, self.first.weight))


def read_another_blocks_weight() -> str:
    epl.init(epl.Config({"zero.level": "v2"}))
    torch.manual_seed(0)
    engine = epl.parallelize(ReadsAnotherBlocksWeight(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    try:
        engine.step(torch.randn(2, 4))
    except Exception as exc:  # the device that explains stops; its peer then loses the connection
        return str(exc)
    return "no error"


def test_v2_explains_a_forward_that_reads_another_blocks_parameter() -> None:
    messages = run_ranks(read_another_blocks_weight, 2, timeout=120)
    assert all("reads another block's parameter directly" in m for m in messages), messages


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"zero.param_dtype": "bfloat16"}, "only applies to ZeRO"),
    ],
)
def test_combinations_that_cannot_work_are_named(config: dict[str, Any], match: str) -> None:
    epl.init(epl.Config(config))
    with pytest.raises(epl.ConfigError, match=match):
        epl.parallelize(tower(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
