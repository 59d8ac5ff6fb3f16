"""Asynchronous saves: training goes on while the files are written, and the checkpoint is the synchronous one.

The background write is held (``dcp.save`` waits for an event in the writer thread) so that the steps
after ``engine.save(..., asynchronous=True)`` certainly run while it is in flight.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import epl
from epl.plugin_api import local_tensor
from epl.runtime.checkpoint import files
from tests.checkpoints.test_layouts import engine_for, step, whole
from tests.helpers.distributed import run_ranks

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def held_background_writes() -> Iterator[threading.Event]:
    """While inside: ``dcp.save`` called outside the main thread (a background save) waits for the event."""
    release, original = threading.Event(), dcp.save

    def held(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            assert release.wait(60), "the test never released the background write"
        return original(*args, **kwargs)

    dcp.save = held
    try:
        yield release
    finally:
        release.set()
        dcp.save = original


def state_of(engine: epl.Engine) -> dict[str, Any]:
    """What a load restored: weights, optimizer state, step counter, random state."""
    optimizer = engine.optimizer.state_dict() if engine.optimizer is not None else {}
    return {
        "model": whole(engine),
        "optimizer": {
            f"{index}/{name}": local_tensor(value).clone()  # ZeRO's states: this rank's chunks
            for index, states in optimizer.get("state", {}).items()
            for name, value in states.items()
        },
        "global_step": engine.global_step,
        "rng": torch.get_rng_state(),
    }


def loaded(layout: str, path: Path) -> dict[str, Any]:
    torch.manual_seed(999)  # the load must restore the saved random state
    engine = engine_for(layout, dropout=0.3)
    engine.load(path)
    return state_of(engine)


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Bit for bit."""
    if a.keys() != b.keys():
        return False
    return all(
        same(a[key], b[key])
        if isinstance(a[key], dict)
        else torch.equal(a[key], b[key])
        if isinstance(a[key], torch.Tensor)
        else a[key] == b[key]
        for key in a
    )


def checksums_hold(folder: Path) -> bool:
    return all(files.checksum(folder / name) == recorded for name, recorded in files.recorded_checksums(folder).items())


def asynchronous_save(layout: str, folder: str) -> dict[str, Any]:
    """Two steps, a synchronous and an asynchronous save of the same state, two steps while the asynchronous one
    is held, then both loaded into fresh engines."""
    root = Path(folder)
    engine = engine_for(layout, dropout=0.3)
    step(engine, 0)
    step(engine, 1)
    engine.save(root / "sync")
    at_save = whole(engine)
    with held_background_writes() as release:
        handle = engine.save(root / "async", asynchronous=True)
        losses = [step(engine, i) for i in (2, 3)]  # training goes on while the write is in flight
        in_flight = not handle.done() and not (root / "async").exists()
        try:
            handle.wait(timeout=0.5)
            late = "no timeout"
        except epl.EplError as error:
            late = str(error)
        release.set()
        handle.wait(timeout=60)
    after = whole(engine)
    leftovers = sorted(path.name for path in root.iterdir() if path.name not in ("sync", "async"))
    return {
        "losses": losses,
        "in_flight": in_flight,
        "late": late,
        "leftovers": leftovers,
        "checksums_hold": checksums_hold(root / "async"),
        "steps_after_changed_weights": any(not torch.equal(at_save[k], after[k]) for k in at_save),
        "async": loaded(layout, root / "async"),
        "sync": loaded(layout, root / "sync"),
        "at_save": at_save,
    }


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_an_asynchronous_save_lets_training_go_on_and_equals_a_synchronous_one(tmp_path: Path) -> None:
    """ZeRO v2 on 2 processes: the steps after save() run while the write is in flight and leave no trace in the
    checkpoint, which loads bit for bit as the synchronous save of the same state (weights, AdamW states, step,
    random state) and passes its checksums; a wait that times out names the ranks still writing."""
    for result in run_ranks(asynchronous_save, 2, "zero v2", str(tmp_path), timeout=110):
        assert result["in_flight"] and len(result["losses"]) == 2
        assert "still being written in the background after 0 s: ranks [0, 1] have not finished" in result["late"]
        assert result["leftovers"] == []  # no .partial, no .old
        assert result["checksums_hold"]
        assert result["steps_after_changed_weights"]
        assert same(result["async"], result["sync"])
        assert same(result["async"]["model"], result["at_save"])
        assert result["async"]["global_step"] == 2


def failing_background_write(folder: str) -> dict[str, Any]:
    """Rank 1's background write fails (a full disk): every rank's next step raises it, the previous checkpoint
    stays, and the next save works."""
    import torch.distributed as dist

    root = Path(folder)
    engine = engine_for("data parallel")
    step(engine, 0)
    engine.save(root / "checkpoint")
    kept = whole(engine)
    step(engine, 1)
    original = files._ChecksummingStream.write

    def full_disk(self: Any, data: Any) -> int:
        if dist.get_rank() == 1 and threading.current_thread() is not threading.main_thread():
            raise OSError(28, "No space left on device")
        return original(self, data)

    files._ChecksummingStream.write = full_disk  # type: ignore[method-assign]
    try:
        handle = engine.save(root / "checkpoint", asynchronous=True)
        deadline = time.monotonic() + 30
        while not handle.done() and time.monotonic() < deadline:  # every rank then fails at the same step
            time.sleep(0.01)
    finally:
        files._ChecksummingStream.write = original  # type: ignore[method-assign]
    errors = []
    for call in (lambda: step(engine, 2), handle.wait):
        try:
            call()
            errors.append("no error")
        except epl.EplError as error:
            errors.append(str(error))
    previous = epl.read_model_state(root / "checkpoint")
    step(engine, 2)  # reported once: training and saving go on
    engine.save(root / "checkpoint")
    now, saved = whole(engine), epl.read_model_state(root / "checkpoint")
    return {
        "errors": errors,
        "previous_kept": all(torch.equal(previous[k], kept[k]) for k in kept),
        "saved_after": all(torch.equal(saved[k], now[k]) for k in now),
    }


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_an_error_of_the_background_write_is_raised_by_the_next_step_and_wait(tmp_path: Path) -> None:
    for result in run_ranks(failing_background_write, 2, str(tmp_path), timeout=80):
        step_error, wait_error = result["errors"]
        for error in (step_error, wait_error):
            assert "written in the background failed" in error and "rank 1" in error, error
            assert "No space left on device" in error, error
        assert result["previous_kept"] and result["saved_after"]


def test_a_save_waits_for_the_one_in_flight_and_a_load_reads_it(tmp_path: Path) -> None:
    """One process: a second save and a load wait for the background write; both checkpoints are complete."""
    engine = engine_for("local")
    step(engine, 0)
    with held_background_writes() as release:
        first = engine.save(tmp_path / "first", asynchronous=True)
        threading.Timer(0.3, release.set).start()
        started = time.monotonic()
        engine.save(tmp_path / "second")
        waited = time.monotonic() - started
        assert first.done() and waited >= 0.25
    fresh = engine_for("local")
    fresh.load(tmp_path / "first")
    assert same(whole(fresh), whole(engine))
    assert same(epl.read_model_state(tmp_path / "second"), whole(engine))


def test_the_end_of_the_process_waits_for_the_background_write(tmp_path: Path) -> None:
    script = f"""
import sys, threading
sys.path.insert(0, {str(ROOT)!r})
import torch.distributed.checkpoint as dcp
from tests.checkpoints.test_layouts import engine_for, step
original = dcp.save
def slow(*args, **kwargs):
    threading.Event().wait(0.5)
    return original(*args, **kwargs)
dcp.save = slow
engine = engine_for("local")
step(engine, 0)
handle = engine.save({str(tmp_path / "checkpoint")!r}, asynchronous=True)
print("returned", handle.done())
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "returned False" in done.stdout
    assert set(epl.read_model_state(tmp_path / "checkpoint")) == set(engine_for("local").model.state_dict())
