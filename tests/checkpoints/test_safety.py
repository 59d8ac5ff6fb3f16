"""Checkpoints that are not what engine.save wrote: nothing in them runs, damage is found, mismatches are named.

Each attack puts a pickle payload that would write a marker file where a loader might
unpickle it, and makes the checkpoint otherwise consistent (checksums recomputed, as an
attacker who can write the files can): loading is refused and the marker never appears.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import epl
from epl.runtime.checkpoint import files
from tests.checkpoints.test_layouts import Net, engine_for, step
from tests.helpers.distributed import run_ranks


class Payload:
    """Unpickling it writes ``marker`` (what an attacker's code would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.write_text, (self.marker, "code from the checkpoint ran"))


def rewrite_checksums(folder: Path) -> None:
    """Record the files as they are now, as an attacker who can write the folder can."""
    for record in folder.glob(".checksums-*.json"):
        record.unlink()
    files.write_checksums(folder, 0, [p.name for p in folder.iterdir() if p.name.endswith((".distcp", ".metadata"))])


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    engine = engine_for("local")
    step(engine, 0)
    engine.save(tmp_path / "checkpoint")
    return tmp_path / "checkpoint"


def load_into_fresh_engine(folder: Path, **options: Any) -> epl.Engine:
    engine = engine_for("local")
    engine.load(folder, **options)
    return engine


def test_a_payload_in_the_dcp_metadata_never_runs(saved: Path, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    metadata = pickle.loads((saved / ".metadata").read_bytes())  # our own file: safe to read here
    metadata.planner_data = Payload(marker)
    (saved / ".metadata").write_bytes(pickle.dumps(metadata))
    rewrite_checksums(saved)
    for load in (lambda: load_into_fresh_engine(saved), lambda: epl.read_model_state(saved)):
        with pytest.raises(epl.EplError, match="refused without running anything from it"):
            load()
    assert not marker.exists()


def test_a_payload_as_epl_metadata_or_rng_state_never_runs(tmp_path: Path) -> None:
    """The layout of older versions: EPL's entries pickled (DCP unpickles such entries with weights_only=False)."""
    marker, folder = tmp_path / "marker", tmp_path / "old"
    model = Net().double()
    items: dict[str, Any] = {f"model/{k}": v for k, v in model.state_dict().items()}
    for key in ("engine/meta", "rng/0"):
        buffer = io.BytesIO(pickle.dumps(Payload(marker)))
        items[key] = buffer
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(items, checkpoint_id=str(folder), no_dist=True)
    rewrite_checksums(folder)
    with pytest.raises(epl.EplError, match="older EPL, which pickled its metadata"):
        load_into_fresh_engine(folder)
    assert set(epl.read_model_state(folder)) == set(model.state_dict())  # the tensors alone are safe to read
    assert not marker.exists()


def test_a_flipped_bit_or_a_truncated_file_is_refused_before_anything_loads(saved: Path) -> None:
    data = next(saved.glob("*.distcp"))
    original = data.read_bytes()
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0x10
    data.write_bytes(bytes(flipped))
    engine = engine_for("local")
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    for load in (lambda: engine.load(saved), lambda: epl.read_model_state(saved)):
        with pytest.raises(epl.EplError, match=rf"{data.name} is damaged: recorded xxh3_64:"):
            load()
    assert all(torch.equal(before[k], v) for k, v in engine.model.state_dict().items())  # nothing was loaded
    data.write_bytes(original[: len(original) // 3])
    with pytest.raises(epl.EplError, match="is damaged"):
        engine.load(saved)
    data.unlink()
    with pytest.raises(epl.EplError, match="found no such file"):
        engine.load(saved)


def test_mismatches_are_errors_that_name_them_and_strict_false_loads_what_matches(saved: Path, tmp_path: Path) -> None:
    epl.init()
    smaller = epl.parallelize(nn.Sequential(nn.Linear(8, 4)).double(), optimizer=lambda p: torch.optim.SGD(p, lr=1))
    with pytest.raises(epl.EplError, match=r"has no 0.weight, 0.bias"):
        smaller.load(saved)

    # Extra tensors: the checkpoint's model has a layer this one lacks.
    epl.init()
    torch.manual_seed(0)
    front_only = Net().double()
    del front_only.back
    front_only.forward = front_only.front.forward  # type: ignore[method-assign]
    engine = epl.parallelize(front_only, optimizer=lambda p: torch.optim.AdamW(p, lr=0.01), loss_fn=nn.MSELoss())
    with pytest.raises(epl.EplError, match=r"tensors the model does not: back.1.bias, back.1.weight"):
        engine.load(saved)
    engine.load(saved, strict=False)
    reference = epl.read_model_state(saved)
    assert torch.equal(engine.model.state_dict()["front.0.weight"], reference["front.0.weight"])

    # Another dtype: a float32 model and a float64 checkpoint.
    epl.init()
    torch.manual_seed(0)
    single = epl.parallelize(Net(), optimizer=lambda p: torch.optim.AdamW(p, lr=0.01), loss_fn=nn.MSELoss())
    dtypes = r"other dtypes than the model's: .*torch.float64 \(the model's torch.float32\)"
    with pytest.raises(epl.EplError, match=dtypes):
        single.load(saved)
    single.load(saved, strict=False)
    assert single.model.state_dict()["front.0.weight"].dtype == torch.float32

    # Another optimizer: SGD into a checkpoint of AdamW.
    epl.init()
    torch.manual_seed(0)
    sgd = epl.parallelize(Net().double(), optimizer=lambda p: torch.optim.SGD(p, lr=0.5), loss_fn=nn.MSELoss())
    with pytest.raises(epl.EplError, match="another kind of optimizer"):
        sgd.load(saved)
    sgd.load(saved, strict=False)  # the model only: SGD keeps its own learning rate
    assert sgd.optimizer is not None and sgd.optimizer.param_groups[0]["lr"] == 0.5


def test_a_checkpoint_without_checksums_is_refused(saved: Path) -> None:
    for record in saved.glob(".checksums-*.json"):
        record.unlink()
    with pytest.raises(epl.EplError, match="has no checksums"):
        load_into_fresh_engine(saved)


def refused_on_one_stage(folder: str) -> str:
    """Rank 1 (stage 1) finds a shape it does not expect; both ranks end with an error, none waits."""
    epl.init(epl.Config({"pipeline.num_micro_batch": 2}))
    torch.manual_seed(0)
    with epl.replicate(1, name="stage_0"):
        front = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    with epl.replicate(1, name="stage_1"):
        back = nn.Sequential(nn.Dropout(0.0), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 5))
    model = nn.Sequential()
    model.front, model.back = front, back
    engine = epl.parallelize(model.double(), optimizer=lambda p: torch.optim.AdamW(p, lr=0.01), loss_fn=nn.MSELoss())
    try:
        engine.load(folder)
    except epl.EplError as error:
        return str(error)
    return "loaded"


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_checkpoint_one_stage_refuses_is_refused_on_every_rank(saved: Path) -> None:
    first, second = run_ranks(refused_on_one_stage, 2, str(saved), timeout=80)
    assert "back.3.weight [4, 16] (the model's [5, 16])" in second
    assert "Rank 1 refused the checkpoint" in first


def test_checkpoint_metadata_is_stored_as_data(saved: Path) -> None:
    """No entry of EPL's is a pickle: engine/meta and the RNG states are tensors."""
    metadata = files.read_metadata(saved / ".metadata")
    entries = metadata.state_dict_metadata
    assert all(hasattr(entry, "size") for entry in entries.values())
    assert {key for key in entries if key.startswith("rng/")} == {"rng/0/torch", "rng/0/python"}
    assert os.path.getsize(saved / ".checksums-0.json") > 0


def test_checksums_taken_while_writing_are_those_of_the_files(saved: Path) -> None:
    """The checksums recorded as the bytes were written match the files read back (every data file and .metadata)."""
    sums = files.recorded_checksums(saved)
    assert {name for name in sums if name.endswith(".distcp")} == {p.name for p in saved.glob("*.distcp")}
    assert ".metadata" in sums
    for name, recorded in sums.items():
        assert files.checksum(saved / name) == recorded, name
