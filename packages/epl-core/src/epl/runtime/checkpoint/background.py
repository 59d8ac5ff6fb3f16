"""Writing a checkpoint, and in the background: the save job, :class:`CheckpointSave`, CPU staging.

``Engine.save(path, asynchronous=True)`` copies the state into CPU buffers (kept between saves, as torchtitan's
async checkpoint keeps pinned ones: :func:`stage`), returns a :class:`CheckpointSave`, and writes the same files in
a background thread over a gloo process group of its own, so training goes on meanwhile; the next save, a load,
``epl.init`` and the end of the process wait for it, and its error surfaces at the next step, save, load or
``wait()``. What this process's saves share (the save in flight, the background group, the store keys) is held by
one :class:`BackgroundSaver`, :data:`SAVER`.
"""

from __future__ import annotations

import atexit
import datetime
import itertools
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from epl.errors import EplError
from epl.runtime.checkpoint import files, folders
from epl.runtime.checkpoint.chunks import Rectangles
from epl.runtime.checkpoint.common import CheckpointedEngine, first_line
from epl.runtime.checkpoint.meeting import named_when_late, quiet_when_alone


@dataclass
class SaveJob:
    """One save: where, by which rank of how many, under which key of the job's store."""

    target: Path
    rank: int
    world_size: int
    alone: bool
    key: str
    timeout: float

    def write(self, items: dict[str, Any], group: Any) -> None:
        """Write ``items`` to ``<target>.partial``, commit it to ``target`` once every rank has written (on DCP's
        ``group``; None: the default group), then delete this rank's files of the previous checkpoint."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        partial = self.target.with_name(self.target.name + ".partial")
        if self.rank == 0:  # a cut-off save's files; no rank writes before DCP's first collective (the plan)
            folders.remove_own(partial, folders.is_checkpoint_file)
        writer = files.checksumming_writer(partial, commit=lambda: folders.replace(partial, self.target, keep_old=True))

        def save() -> Any:
            return dcp.save(items, storage_writer=writer, process_group=group, no_dist=self.alone)

        try:
            with quiet_when_alone(self.alone):
                named_when_late(self.key, self.rank, self.world_size, self.alone, "engine.save", save)
        except CheckpointException as error:
            # Every rank has stopped writing (DCP raises on all of them at once, after its last collective).
            if self.rank == 0:
                folders.remove_own(partial, folders.is_checkpoint_file)
            raise save_error(self.target, error) from None
        # Each rank deletes its own files of the previous checkpoint, in parallel (as DCP by hand truncates its
        # own files when it overwrites them); rank 0 then removes the rest.
        folders.discard(self.target.with_name(self.target.name + ".old"), self.rank)

    def unfinished_ranks(self) -> list[int] | None:
        """The ranks that have not finished writing (None: the job's store cannot say)."""
        if self.alone:
            return [0]
        try:
            import torch.distributed as dist

            store = dist.distributed_c10d._get_default_store()
            return [r for r in range(self.world_size) if not store.check([f"{self.key}/done/{r}"])]
        except (RuntimeError, ValueError):
            return None


def save_error(target: Path, error: BaseException) -> EplError:
    """DCP's CheckpointException of a save as one EplError naming the first failing rank; a full disk says so and
    what is left (the previous checkpoint, untouched)."""
    failure = checkpoint_error(f"engine.save could not write {target}", error)
    if "No space left on device" in str(failure):
        return EplError(
            f"{failure}. Nothing was committed: the previous checkpoint at {target}, if any, is intact and the "
            "partial files were deleted. Free space, or save to another file system."
        )
    return failure


def checkpoint_error(what: str, error: BaseException) -> EplError:
    """DCP's CheckpointException (every failing rank's exception) as one EplError naming the first."""
    failures = getattr(error, "failures", {}) or {}
    if not failures:
        return EplError(f"{what}: {first_line(error)}")
    rank, (first, _) = min(failures.items())
    return EplError(f"{what}: rank {rank}: {first_line(first)}")


class CheckpointSave:
    """A checkpoint being written: what ``engine.save`` returns (done at once unless ``asynchronous=True``).

    An asynchronous save writes from CPU copies of the state made before ``engine.save`` returned, so the steps
    that follow change nothing in it. It is complete when :meth:`done`; :meth:`wait` waits for it and raises its
    error. Whatever nobody waited for is waited for by the next ``engine.save``, ``engine.load``, ``epl.init``
    and the end of the process, and an error of the background write is raised by the next of those or of
    ``engine.step``, once.
    """

    def __init__(self, job: SaveJob, *, finished: bool) -> None:
        self._job = job
        #: The checkpoint directory written.
        self.path = job.target
        self._finished = threading.Event()
        self._error: BaseException | None = None
        self._reported = False
        if finished:
            self._finished.set()

    def done(self) -> bool:
        """Whether the checkpoint is written and committed (or its writing failed)."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Wait until the checkpoint is written (at most ``timeout`` seconds; default: ``communication.timeout``).

        Raises :class:`epl.EplError` naming the ranks that have not finished when the time is up, and the
        error of the background write when it failed.
        """
        self._join(timeout)
        if self._error is not None:
            self._reported = True
            raise self._failure() from self._error

    def surface(self) -> None:
        """Raise the background write's error if it failed and nobody has seen the error yet (once)."""
        if self.done() and self._error is not None and not self._reported:
            self._reported = True
            raise self._failure() from self._error

    def _join(self, timeout: float | None) -> None:
        limit = self._job.timeout if timeout is None else timeout
        if not self._finished.wait(limit):
            late = self._job.unfinished_ranks()
            who = f"ranks {late} have not finished writing their part" if late is not None else "some rank is late"
            raise EplError(
                f"The checkpoint {self.path} is still being written in the background after {limit:.0f} s: {who} "
                "(stuck, on slow storage, or not calling engine.save with the others)."
            )

    def _failure(self) -> EplError:
        assert self._error is not None
        return EplError(f"The checkpoint {self.path} written in the background failed: {first_line(self._error)}")

    def _start(self, write: Callable[[], None]) -> None:
        def run() -> None:
            try:
                write()
            except BaseException as error:  # noqa: BLE001 - kept for wait(), the next step, save or load
                self._error = error
            finally:
                self._finished.set()

        threading.Thread(target=run, name=f"epl-checkpoint-save-{self.path.name}", daemon=True).start()

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "done" if self.done() else "writing"
        return f"CheckpointSave({str(self.path)!r}, {state})"


class BackgroundSaver:
    """What this process's saves share: the save written in the background (at most one: a save waits for the one
    before), the gloo group background saves write over, the count of saves (their keys in the job's store), and
    whether the end of the process waits for a save in flight."""

    def __init__(self) -> None:
        self.in_flight: CheckpointSave | None = None
        self._calls = itertools.count()
        #: The default group the background group was made beside, and the background group (gloo).
        self._group: tuple[Any, Any] | None = None
        self._exit_wait_registered = False

    def next_key(self) -> str:
        """The job's store key of the next save (the same on every rank: every rank saves in the same order)."""
        return f"epl/checkpoint/{next(self._calls)}"

    def start(self, job: SaveJob, staged: dict[str, Any], group: Any) -> CheckpointSave:
        """Write ``staged`` for ``job`` in a background thread over ``group``; the save is now in flight."""
        handle = CheckpointSave(job, finished=False)
        handle._start(lambda: job.write(staged, group))
        self.in_flight = handle
        self._wait_at_exit()
        return handle

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the save in flight, if any, and raise its error if nobody has seen it yet."""
        pending = self.in_flight
        if pending is None:
            return
        pending._join(timeout)
        self.in_flight = None
        pending.surface()

    def group(self, timeout: float) -> Any:
        """A gloo process group over every rank for background saves, so their collectives never share a group
        with training's (torchtitan's async checkpoint does the same). Made once per default group, by the first
        asynchronous save (every rank makes it there)."""
        import torch.distributed as dist

        world = dist.group.WORLD
        if self._group is None or self._group[0] is not world:
            self._group = (world, dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout)))
        return self._group[1]

    def _wait_at_exit(self) -> None:
        """At the end of the process, wait for a checkpoint still being written (its error printed)."""
        if self._exit_wait_registered:
            return
        self._exit_wait_registered = True

        def wait() -> None:
            try:
                self.wait()
            except BaseException as error:  # noqa: BLE001 - the process is ending: say it
                print(f"EPL: {error}", file=sys.stderr, flush=True)

        atexit.register(wait)


#: This process's background saver: the only state the checkpoint modules keep between calls.
SAVER = BackgroundSaver()


def wait_for_background_save(timeout: float | None = None) -> None:
    """Wait for the checkpoint this process is writing in the background, if any, and raise its error if it
    failed and nobody has seen the error yet (``engine.save`` and ``engine.load`` call it first)."""
    SAVER.wait(timeout)


@dataclass
class _Staging:
    """The CPU buffers asynchronous saves copy the state into, kept between saves (one engine's)."""

    buffers: dict[str, torch.Tensor] = field(default_factory=dict)


def stage(engine: CheckpointedEngine, items: dict[str, Any]) -> dict[str, torch.Tensor]:
    """CPU copies of ``items``' tensors, in buffers kept for the next save (pinned for CUDA tensors).

    Kept because a fresh buffer costs its page faults on every save: measured, copying 75 MB into new memory
    takes 31 ms, into memory already touched 12 ms.
    """
    buffers = engine.context.state(_Staging).buffers
    staged: dict[str, torch.Tensor] = {}
    used: dict[str, bool] = {}  # name -> from a CUDA tensor

    def copy(name: str, value: torch.Tensor) -> torch.Tensor:
        value = value.detach()
        buffer = buffers.get(name)
        if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
            buffer = torch.empty(value.shape, dtype=value.dtype, pin_memory=value.is_cuda)
            buffers[name] = buffer
        buffer.copy_(value, non_blocking=value.is_cuda)
        used[name] = value.is_cuda
        return buffer

    for key, value in items.items():
        if isinstance(value, Rectangles):  # each rectangle on its own: never a buffer of the logical shape
            parts = [copy(f"{key}@{list(offsets)}", part) for offsets, part in value.blocks]
            staged[key] = value.holding(parts)
        else:
            staged[key] = copy(key, value)
    cuda = any(used.values())
    for name in set(buffers) - set(used):
        del buffers[name]
    if cuda:
        torch.cuda.synchronize()
    return staged
