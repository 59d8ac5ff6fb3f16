"""Checkpoints any layout can load: whole tensors under the unsplit model's names, written in parallel.

``Engine.save(path)`` writes a directory with ``torch.distributed.checkpoint`` (DCP):
every rank writes its own file at the same time, and a tensor several ranks hold
(a replicated weight) is written once. What is saved is *logical*, not per device:

- ``model/<name>``: each parameter and buffer as the whole tensor, under the name it has in the model the user
  wrote. Each rank writes the rectangles of it that it holds (a split piece, an FSDP2 ``DTensor`` chunk, a chunk
  of a split piece: :mod:`epl.sharding.chunks`, :mod:`epl.runtime.checkpoint_chunks`), so nothing is gathered;
- ``optim/<name>/<state>``: the optimizer state of each parameter (Adam's ``exp_avg``...), a logical tensor
  stored as its parameter is when shaped like it (others, such as ``step``, whole), written by whichever device
  keeps it (under the owner-based ZeRO, the owner). Format 2 stored a split parameter's states as
  ``.../shard<i>of<n>dim<d>`` pieces, which are still read;
- ``engine/meta``: the step counter, the optimizer's hyperparameters, the loss scaler (JSON
  text in a uint8 tensor: nothing in a checkpoint is pickled by EPL);
- ``rng/<rank>/<generator>``: every rank's random number generator states;
- ``data/<rank>``: where each rank's ``epl.io`` loaders stand (JSON, :mod:`epl.io.positions`).

``Engine.load(path)`` reads what this rank's layout needs, whatever layout saved it: a
pipeline stage reads its stage's names, a split or sharded device reads its rectangles, a
ZeRO owner reads the states it owns. Writing goes to ``<path>.partial`` and is renamed
to ``<path>`` once every rank has finished (in DCP's ``finish`` step on the coordinator, which
every rank waits for), so a crash while saving leaves the previous checkpoint intact. Only a checkpoint of EPL's
own is replaced, and only EPL's files are deleted: a folder holding anything else is refused on every rank before
anything is moved (:mod:`epl.runtime.checkpoint_folders`). ``save`` and ``load`` first meet every rank through the
job's store, so a rank that does not call them is named (:mod:`epl.runtime.collective_calls`).

``Engine.save(path, asynchronous=True)`` copies the state into CPU buffers (kept between saves,
as torchtitan's async checkpoint keeps pinned ones), returns a :class:`CheckpointSave`, and writes
the same files in a background thread over a gloo process group of its own, so training goes on
meanwhile; the next save, a load, ``epl.init`` and the end of the process wait for it, and its
error surfaces at the next step, save, load or ``wait()``.

Loading never runs code from the checkpoint and checks it first (:mod:`epl.runtime.checkpoint_files`):
every file against its recorded checksum, then, strictly by default, that the names,
shapes and dtypes are the model's and the optimizer is of the same kind. Every rank agrees
before anything is loaded (one all-reduce), so a refused checkpoint is one error on every rank,
not a hang. Each rank reads what it needs on its own (DCP's load needs no collective for that).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import fnmatch
import itertools
import os
import random
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from epl.errors import EplError
from epl.interfaces.optimizer_groups import group_options
from epl.runtime import agreement
from epl.runtime import checkpoint_files as files
from epl.runtime import checkpoint_folders as folders
from epl.runtime.checkpoint_chunks import Rectangles, local_value, to_read, to_write
from epl.runtime.collective_calls import agree_to_call
from epl.sharding.chunks import held, placed_like
from epl.sharding.data_shards import local_tensor
from epl.sharding.parameters import assemble, shard_spec

if TYPE_CHECKING:
    from epl.placement.plan import Plan
    from epl.plugins.context import LossScaler, ParallelContext


class CheckpointedEngine(Protocol):
    """What saving and loading read and restore of :class:`epl.runtime.engine.Engine` (which calls them)."""

    global_step: int
    context: ParallelContext

    @property
    def skipped_steps(self) -> int:
        """Steps whose update was skipped (non-finite), kept across a save and load."""
        ...

    @property
    def model(self) -> nn.Module:
        """This rank's model."""
        ...

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """This rank's optimizer."""
        ...

    @property
    def loss_scaler(self) -> LossScaler | None:
        """The loss scaler (AMP), if any."""
        ...

    @property
    def plan(self) -> Plan:
        """The Plan the engine runs."""
        ...

    @property
    def lr_scheduler(self) -> Any:
        """The LR scheduler the engine steps, if any."""
        ...

    def state_dict(self, *, full: bool = False) -> dict[str, Any]:
        """The engine's state (``full``: whole tensors gathered from shards)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        ...


#: Identifies the layout of the directory. 3: every logical tensor (model and optimizer states alike) is stored as
#: the rectangles its ranks held, at their offsets. 2 (read too): model tensors whole, and a split parameter's
#: states as its pieces, ``optim/<name>/<state>/shard<i>of<n>dim<d>[parts<p>]``.
FORMAT = "epl-checkpoint/3"
#: The formats this version reads.
_READABLE = ("epl-checkpoint/2", FORMAT)
#: Options an LR scheduler adds to the optimizer's groups: not part of the optimizer's kind.
_SCHEDULER_OPTIONS = {"initial_lr"}


# -- saving ------------------------------------------------------------------------------------
def save_checkpoint(
    engine: CheckpointedEngine, path: str | os.PathLike[str], *, asynchronous: bool = False
) -> CheckpointSave:
    """Write ``engine``'s logical state to the directory ``path`` (a collective: every rank calls it).

    ``asynchronous``: copy the state to CPU memory, return at once, and write the files in a background thread
    (see :class:`CheckpointSave`). A save still being written in the background is waited for first.
    """
    _require_default_group(engine)
    wait_for_background_save()
    target = Path(path)
    # Refused on every rank before anything is moved or deleted: a folder holding what engine.save did not write.
    _meet(engine, "engine.save", lambda: folders.save_problem(target))
    items = _logical_items(engine)
    cluster, alone = engine.context.cluster, _alone(engine)
    job = _SaveJob(target, cluster.rank, cluster.world_size, alone, f"epl/checkpoint/{next(_calls)}", _timeout(engine))
    if not asynchronous:
        with _without_zip_crc():
            job.write(items, None)
        return CheckpointSave(job, finished=True)
    staged = _stage(engine, items)
    group = None if alone else _background_group(job.timeout)
    handle = CheckpointSave(job, finished=False)
    handle._start(lambda: job.write(staged, group))
    global _in_flight
    _in_flight = handle
    _wait_at_exit()
    return handle


@contextlib.contextmanager
def _without_zip_crc() -> Iterator[None]:
    """Without the CRC-32 ``torch.save`` computes for every record of the zip archive it writes for each tensor.

    torch.load never checks it (a flipped bit in a tensor's bytes loads silently), and EPL's XXH3 checksum of
    every file, checked on every load, covers the same bytes. Measured on the checkpoint benchmark: the CRC-32
    took 29 ms of DCP's 49 ms to write 42 MB (XXH3: 2.3 ms). torch's switch is process-wide, so it is turned off
    only while a save holds the main thread, and background saves keep it.
    """
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


@dataclass
class _SaveJob:
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
        writer = files.checksumming_writer(partial, commit=lambda: _replace(partial, self.target, keep_old=True))

        def save() -> Any:
            return dcp.save(items, storage_writer=writer, process_group=group, no_dist=self.alone)

        try:
            with _quiet_when_alone(self.alone):
                _named_when_late(self.key, self.rank, self.world_size, self.alone, "engine.save", save)
        except CheckpointException as error:
            # Every rank has stopped writing (DCP raises on all of them at once, after its last collective).
            if self.rank == 0:
                folders.remove_own(partial, folders.is_checkpoint_file)
            raise _save_error(self.target, error) from None
        # Each rank deletes its own files of the previous checkpoint, in parallel (as DCP by hand truncates its
        # own files when it overwrites them); rank 0 then removes the rest.
        _discard(self.target.with_name(self.target.name + ".old"), self.rank)

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


class CheckpointSave:
    """A checkpoint being written: what ``engine.save`` returns (done at once unless ``asynchronous=True``).

    An asynchronous save writes from CPU copies of the state made before ``engine.save`` returned, so the steps
    that follow change nothing in it. It is complete when :meth:`done`; :meth:`wait` waits for it and raises its
    error. Whatever nobody waited for is waited for by the next ``engine.save``, ``engine.load``, ``epl.init``
    and the end of the process, and an error of the background write is raised by the next of those or of
    ``engine.step``, once.
    """

    def __init__(self, job: _SaveJob, *, finished: bool) -> None:
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
        return EplError(f"The checkpoint {self.path} written in the background failed: {_first_line(self._error)}")

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


#: The save this process writes in the background (at most one: a save waits for the one before).
_in_flight: CheckpointSave | None = None


def wait_for_background_save(timeout: float | None = None) -> None:
    """Wait for the checkpoint this process is writing in the background, if any, and raise its error if it
    failed and nobody has seen the error yet (``engine.save`` and ``engine.load`` call it first)."""
    global _in_flight
    pending = _in_flight
    if pending is None:
        return
    pending._join(timeout)
    _in_flight = None
    pending.surface()


_exit_wait_registered = False


def _wait_at_exit() -> None:
    """At the end of the process, wait for a checkpoint still being written (its error printed)."""
    global _exit_wait_registered
    if _exit_wait_registered:
        return
    _exit_wait_registered = True

    def wait() -> None:
        try:
            wait_for_background_save()
        except BaseException as error:  # noqa: BLE001 - the process is ending: say it
            print(f"EPL: {error}", file=sys.stderr, flush=True)

    atexit.register(wait)


@dataclass
class _Staging:
    """The CPU buffers asynchronous saves copy the state into, kept between saves (one engine's)."""

    buffers: dict[str, torch.Tensor] = field(default_factory=dict)


def _stage(engine: CheckpointedEngine, items: dict[str, Any]) -> dict[str, torch.Tensor]:
    """CPU copies of ``items``' tensors, in buffers kept for the next save (pinned for CUDA tensors).

    Kept because a fresh buffer costs its page faults on every save: measured, copying 75 MB into new memory
    takes 31 ms, into memory already touched 12 ms.
    """
    buffers = engine.context.state(_Staging).buffers
    staged: dict[str, torch.Tensor] = {}
    used: dict[str, bool] = {}  # name -> from a CUDA tensor

    def stage(name: str, value: torch.Tensor) -> torch.Tensor:
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
            parts = [stage(f"{key}@{list(offsets)}", part) for offsets, part in value.blocks]
            staged[key] = value.holding(parts)
        else:
            staged[key] = stage(key, value)
    cuda = any(used.values())
    for name in set(buffers) - set(used):
        del buffers[name]
    if cuda:
        torch.cuda.synchronize()
    return staged


#: The default group the background group was made beside, and the background group (gloo).
_background: tuple[Any, Any] | None = None


def _background_group(timeout: float) -> Any:
    """A gloo process group over every rank for background saves, so their collectives never share a group with
    training's (torchtitan's async checkpoint does the same). Made once per default group, by the first
    asynchronous save (every rank makes it there)."""
    import torch.distributed as dist

    global _background
    world = dist.group.WORLD
    if _background is None or _background[0] is not world:
        _background = (world, dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout)))
    return _background[1]


def _timeout(engine: CheckpointedEngine) -> float:
    """``communication.timeout``: how long a checkpoint collective, or a wait for a background save, may take."""
    try:
        return float(engine.context.config["communication.timeout"])
    except (KeyError, TypeError, ValueError):
        return 1800.0


def _logical_items(engine: CheckpointedEngine) -> dict[str, Any]:
    """Everything a save writes, by key: each logical tensor as this rank's rectangles of it (nothing gathered)."""
    own = engine.model.state_dict(keep_vars=True)  # FSDP2's pre-hook puts its sharded parameters back first
    values = engine.model.state_dict()  # a technique that frees parameters between uses hands copies here
    items: dict[str, Any] = {
        f"model/{key}": to_write(held(tensor), local_tensor(values[key])) for key, tensor in own.items()
    }
    optimizer = engine.optimizer
    if optimizer is not None:
        for name, param in engine.model.named_parameters():
            state = optimizer.state.get(param)
            if not state:
                continue
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    items[f"optim/{name}/{key}"] = to_write(held(value, like=param), local_tensor(value))
    scaler = engine.loss_scaler
    meta = {
        "format": FORMAT,
        "global_step": engine.global_step,
        "skipped_steps": engine.skipped_steps,
        "param_groups": [group_options(group) for group in optimizer.param_groups] if optimizer is not None else None,
        "loss_scaler": scaler.state_dict() if scaler is not None else None,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
    }
    items["engine/meta"] = files.encode_json(meta)
    items.update({f"rng/{engine.context.cluster.rank}/{k}": v for k, v in _rng_state().items()})
    items.update(_data_items(engine.context.cluster.rank))
    return items


# -- loading -----------------------------------------------------------------------------------
def load_checkpoint(engine: CheckpointedEngine, path: str | os.PathLike[str], *, strict: bool = True) -> None:
    """Restore what :func:`save_checkpoint` wrote, into ``engine``'s layout (every rank calls it).

    ``strict`` (default): the checkpoint must hold exactly the model's tensors, with their shapes and
    dtypes, and an optimizer of the same kind. ``strict=False`` loads what matches: extra tensors are
    ignored, missing ones keep their values, dtypes are converted, and the optimizer state is
    skipped when the optimizer differs. Shapes must match either way.
    """
    _require_default_group(engine)
    wait_for_background_save()
    _meet(engine, "engine.load")
    read = _read(engine, Path(path), strict)  # checked and agreed by every rank: nothing was applied before
    own = engine.model.state_dict(keep_vars=True)
    # This rank's part of each tensor, as the model holds it (a DTensor for a DTensor parameter).
    model = {
        key: placed_like(local_value(read.tensors[item], held(own[key])), own[key])
        for key, item in read.model_keys.items()
    }
    if not strict:  # what missing tensors keep
        model.update({key: value for key, value in engine.model.state_dict().items() if key not in model})
    pieces = {
        key: [spec.group.index, spec.group.count] for key, t in own.items() if (spec := shard_spec(t)) is not None
    }
    meta = read.meta
    engine.load_state_dict(
        {
            "version": 1,
            "model": model,
            "optimizer": None,
            "global_step": meta["global_step"],
            "skipped_steps": meta.get("skipped_steps", 0),  # absent from checkpoints before issue 40
            "shards": pieces,  # every split tensor of ``model`` is this rank's piece already
        }
    )
    if engine.optimizer is not None and read.optimizer_problem is None:
        device = engine.context.cluster.device
        _restore_optimizer(engine.optimizer, read.states, read.tensors, meta["param_groups"], device)
    if engine.loss_scaler is not None and meta["loss_scaler"] is not None:
        engine.loss_scaler.load_state_dict(meta["loss_scaler"])
    if engine.lr_scheduler is not None and meta.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    rng_prefix = f"rng/{engine.context.cluster.rank}/"
    rank_rng = {key[len(rng_prefix) :]: value for key, value in read.tensors.items() if key.startswith(rng_prefix)}
    if rank_rng:
        _set_rng_state(rank_rng)
    _restore_data_positions(read.tensors, strict)


@dataclass
class _Read:
    """What :func:`_read` read and decided, before anything is applied."""

    #: Every tensor read, by checkpoint key.
    tensors: dict[str, torch.Tensor]
    #: The checkpoint key of each of this rank's model tensors found in the checkpoint.
    model_keys: dict[str, str]
    #: Each (parameter, optimizer state name) to restore, with the checkpoint keys holding it.
    states: list[tuple[tuple[nn.Parameter, str], list[str]]]
    #: EPL's own entry: step counter, optimizer options, loss scaler.
    meta: dict[str, Any]
    #: Why the optimizer state is not restored (None: it is).
    optimizer_problem: str | None


def _read(engine: CheckpointedEngine, path: Path, strict: bool) -> _Read:
    """Read what this rank needs from the checkpoint at ``path`` into tensors of its own while its share of the files
    is verified, check it against ``engine``, and agree with every rank before returning: a damaged, missing or
    unreadable file, or a problem any rank found, is an error on every rank, naming the file (and, on the other
    ranks, the rank that found it), and nothing was applied on any rank (:func:`_agree`: one all-reduce when every
    rank succeeded)."""
    from torch.distributed.checkpoint.api import CheckpointException

    cluster, several = engine.context.cluster, not _alone(engine)
    verification: _Verification | None = None
    found: _Read | None = None
    names: list[str] = []
    held: list[bool] = []
    problem: str | None = None
    try:
        folder = _readable(path)
        verification = _Verification(folder, cluster.rank, cluster.world_size) if several else _Verification(folder)
        found, names, held, problem = _read_here(engine, folder, strict)
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - any failure to read is agreed by every rank
        cause = _cause(error)
        named = isinstance(cause, EplError)
        problem = str(cause) if named else f"Cannot load the checkpoint {path}: {type(cause).__name__}: {cause}"
    damaged, unchecked = verification.result() if verification is not None else (0, None)
    if damaged and verification is not None:  # a damaged file explains whatever reading it raised, on any rank
        problem, weight = str(verification.error(damaged)), _DAMAGED
    else:
        problem, weight = unchecked or problem, agreement.REFUSED
    _agree(engine, problem, weight)
    assert found is not None
    if several and names:
        flags = torch.tensor(held, dtype=torch.int64)
        engine.context.communicator.all_reduce(flags, _max()).wait()
        held = [bool(flag) for flag in flags.tolist()]
    extra = [name for name, here in zip(names, held, strict=True) if not here]
    if extra:
        raise EplError(
            f"The checkpoint has tensors the model does not: {_few(extra)}. Load it into the model it was saved "
            "from, or pass strict=False to load what matches."
        )
    return found


#: The weight (:func:`epl.runtime.agreement.agree`) of a damaged file: it explains the errors of reading it.
_DAMAGED = 2


def _read_here(
    engine: CheckpointedEngine, folder: Path, strict: bool
) -> tuple[_Read, list[str], list[bool], str | None]:
    """This rank's part of :func:`_read`, before the agreement: what it read, the checkpoint's model names (strict
    only) and whether this rank holds each, and why the checkpoint cannot load here (None: it can)."""
    rank = engine.context.cluster.rank
    reader = files.safe_reader(folder)  # reads .metadata once, for these checks and for DCP's load
    saved = reader.read_metadata().state_dict_metadata
    meta_entry = saved.get("engine/meta")
    if meta_entry is None:
        raise EplError(f"{folder} is not an EPL checkpoint (no engine/meta); write one with engine.save(path).")
    if not hasattr(meta_entry, "size"):
        raise EplError(
            f"{folder} was written by an older EPL, which pickled its metadata; this version never unpickles a "
            "checkpoint. Load it with that version and save it again with this one."
        )
    local = engine.model.state_dict(keep_vars=True)
    holdings = {key: held(tensor) for key, tensor in local.items()}
    problem, keys = _model_problems(saved, local, holdings, strict)
    # The checkpoint's model tensors no rank holds (each rank may hold only its stage): agreed by _read.
    names = sorted(key[len("model/") :] for key in saved if key.startswith("model/")) if strict else []
    here = [name in local for name in names]
    states = _wanted_states(engine, saved)
    # This rank's rectangles of each tensor it holds part of; whole tensors (and the pieces of a format 2 split
    # parameter's states, assembled then cut) else.
    wanted = {item: to_read(holdings[key], saved[item].size, _dtype(saved[item])) for key, item in keys.items()}
    for (param, _), state_keys in states:
        holding = held(param) if len(state_keys) == 1 else None
        for key in state_keys:
            fits = holding is not None and tuple(saved[key].size) == holding.shape
            wanted[key] = to_read(holding if fits else None, saved[key].size, _dtype(saved[key]))
    plain = ["engine/meta", *(key for key in saved if key.startswith((f"rng/{rank}/", "data/")))]  # data: every rank's
    wanted.update({key: _placeholder(saved[key]) for key in plain})
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {}
    optimizer_problem = None
    if problem is None:
        tensors, problem = _load(reader, wanted, folder)
    if problem is None:
        meta, problem = _decoded_meta(tensors["engine/meta"], folder)
    if problem is None:
        optimizer_problem = _optimizer_problem(engine, meta)
        if strict:
            problem = optimizer_problem or _scheduler_problem(engine, meta)
    if problem is None:
        problem = _data_problem(tensors, strict)
    read = _Read(tensors, keys, [] if optimizer_problem is not None else states, meta, optimizer_problem)
    return read, names, here, problem


class _Verification:
    """Checks files of ``folder`` against their recorded checksums in a thread (hashing releases the GIL) while the
    caller reads them: this rank's share of them (``rank``, ``world_size``: every rank checks its own files,
    round-robin)."""

    def __init__(self, folder: Path, rank: int = 0, world_size: int = 1) -> None:
        self.folder = folder
        self.sums = files.recorded_checksums(folder)
        self.names = sorted(self.sums)
        self._outcome: list[str | None | BaseException] = []
        self._thread = threading.Thread(
            target=self._check, args=(self.names[rank::world_size],), name="epl-checkpoint-verify", daemon=True
        )
        self._thread.start()

    def _check(self, names: list[str]) -> None:
        try:
            self._outcome.append(files.first_damaged(self.folder, names, self.sums))
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
            self._outcome.append(error)

    def result(self) -> tuple[int, str | None]:
        """Once checked: the first damaged file found (its index in :attr:`names` plus one; 0: none), and why the
        files could not be checked (None: they were)."""
        self._thread.join()
        outcome = self._outcome[0]
        if isinstance(outcome, BaseException):
            return 0, f"Cannot check the checkpoint {self.folder}: {outcome}"
        return (self.names.index(outcome) + 1 if outcome is not None else 0), None

    def error(self, damaged: int) -> EplError:
        """The error for the file :meth:`result` found damaged."""
        return files.damaged_file_error(self.folder, self.names[damaged - 1], self.sums)

    @contextlib.contextmanager
    def blaming_damage(self) -> Iterator[None]:
        """Around reading the files: an error raised while reading is replaced by the damaged-file error when a
        file turns out damaged (a damaged file explains whatever reading it raised)."""
        try:
            yield
        except BaseException:
            damaged, _ = self.result()
            if damaged:
                raise self.error(damaged) from None
            raise


def _model_problems(
    saved: dict[str, Any], local: dict[str, torch.Tensor], holdings: dict[str, Any], strict: bool
) -> tuple[str | None, dict[str, str]]:
    """What keeps the checkpoint's model tensors from loading into this rank's (None: nothing), and the checkpoint
    key of each local tensor to load (``holdings``: what this rank holds of each). (Tensors no rank holds are found
    by :func:`_read`, over every rank.)"""
    absent = [key for key in local if f"model/{key}" not in saved]
    keys = {key: f"model/{key}" for key in local if key not in absent}
    shapes, dtypes = [], []
    for key, item in keys.items():
        tensor, whole = local[key], list(holdings[key].shape)
        if list(saved[item].size) != whole:
            shapes.append(f"{key} {list(saved[item].size)} (the model's {whole})")
        if _dtype(saved[item]) != tensor.dtype:
            dtypes.append(f"{key} {_dtype(saved[item])} (the model's {tensor.dtype})")
    fix = " Load it into the model it was saved from, or pass strict=False to load what matches."
    if shapes:
        return f"The checkpoint's tensors have other shapes than the model's: {_few(shapes)}.", keys
    if strict and absent:
        return (
            f"The checkpoint has no {_few(absent)}: it was saved from a different model (the names are those of the "
            f"model as written, before EPL).{fix}",
            keys,
        )
    if strict and dtypes:
        return f"The checkpoint's tensors have other dtypes than the model's: {_few(dtypes)}.{fix}", keys
    return None, keys


def _scheduler_problem(engine: CheckpointedEngine, meta: dict[str, Any]) -> str | None:
    if engine.lr_scheduler is not None and meta.get("lr_scheduler") is None:
        return (
            "The checkpoint has no LR scheduler state, but this engine has an LR scheduler: it would restart its "
            "schedule. Save from an engine with the same scheduler, or pass strict=False to keep the scheduler as "
            "it is."
        )
    return None


def _optimizer_problem(engine: CheckpointedEngine, meta: dict[str, Any]) -> str | None:
    """Why the checkpoint's optimizer state cannot be restored into this engine's optimizer (None: it can)."""
    optimizer, groups = engine.optimizer, meta["param_groups"]
    if optimizer is None or groups is None:
        return None
    if len(groups) != len(optimizer.param_groups):
        return (
            f"The checkpoint's optimizer had {len(groups)} parameter groups, this one has "
            f"{len(optimizer.param_groups)}: build the optimizer with the same groups to resume (or pass "
            "strict=False to load the model only)."
        )
    saved_options = sorted(set(groups[0]) - _SCHEDULER_OPTIONS)
    options = sorted(set(group_options(optimizer.param_groups[0])) - _SCHEDULER_OPTIONS)
    if saved_options != options:
        return (
            f"The checkpoint was saved with another kind of optimizer (options {saved_options}), this one has "
            f"options {options}: build the same optimizer class to resume (or pass strict=False to load the "
            "model only)."
        )
    return None


def _agree(engine: CheckpointedEngine, problem: str | None, weight: int = agreement.REFUSED) -> None:
    """Raise ``problem`` on this rank and, on every other, an error naming the refusing rank and its reason (a
    collective: :func:`epl.runtime.agreement.agree`)."""
    communicator = None if _alone(engine) else engine.context.communicator
    agreement.agree(communicator, problem, refused="refused the checkpoint", weight=weight)


def _load(reader: Any, wanted: dict[str, torch.Tensor], folder: Path) -> tuple[dict[str, torch.Tensor], str | None]:
    """DCP's load of ``wanted`` (placeholders) from ``folder`` through ``reader`` (:func:`files.safe_reader`): the
    tensors read, and why they could not be (None: they were).

    Each rank loads alone (``no_dist``): what a rank reads depends on no other rank, so DCP's planning and
    read collectives (two object collectives per load) would only say whether every rank's read went well, which
    :func:`_read`'s one all-reduce says as well.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _quiet_when_alone(True):
            dcp.load(wanted, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - any failure to read is a refusal, agreed
        return {}, f"Cannot load the checkpoint {folder}: {_first_line(_cause(error))}"
    return reader.loaded, None


def _cause(error: BaseException) -> BaseException:
    """The error behind DCP's CheckpointException (a BaseException holding each failing rank's; without
    torch.distributed, this process's alone), else ``error``."""
    failures = getattr(error, "failures", None) or {}
    return min(failures.items())[1][0] if failures else error


def _decoded_meta(data: torch.Tensor, folder: Path) -> tuple[dict[str, Any], str | None]:
    try:
        meta = files.decode_json(data)
        if not isinstance(meta, dict) or "global_step" not in meta:
            raise ValueError("not EPL's")
    except (ValueError, TypeError, UnicodeDecodeError) as error:
        return {}, f"The checkpoint {folder} has an unreadable engine/meta entry ({error})."
    if meta.get("format") not in _READABLE:
        return {}, (
            f"The checkpoint {folder} is in the format {meta.get('format')!r}; this EPL reads {list(_READABLE)}. "
            "Load it with the EPL that wrote it."
        )
    return meta, None


def _placeholder(metadata: Any) -> torch.Tensor:
    """A tensor of the entry's shape and dtype for DCP's planner, never written (so its pages are never touched):
    the reader keeps the tensor it reads instead. (DCP turns ``meta`` tensors into tensors on the default
    process group's device.)"""
    return torch.empty(metadata.size, dtype=_dtype(metadata))


_calls = itertools.count()
#: Seconds a rank whose checkpoint collective timed out waits for the other waiting ranks to say so.
_LATE_SETTLE_SECONDS = 2.0


def _named_when_late(key: str, rank: int, world_size: int, alone: bool, what: str, action: Callable[[], Any]) -> Any:
    """Run ``action`` (torch.distributed.checkpoint's collectives); when it times out, name the ranks that never
    finished it nor timed out themselves (the late ones), as EPL's own collectives do.

    Every rank records under ``key`` in the job's store that it finished, or that it timed out; the ranks with
    neither did not arrive.
    """
    import torch.distributed as dist

    if alone:
        return action()
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):  # no store: DCP's own error
        return action()
    try:
        result = action()
    except RuntimeError as error:
        if "timed out" not in str(error).lower():
            raise
        store.set(f"{key}/timed_out/{rank}", "1")
        time.sleep(_LATE_SETTLE_SECONDS)
        late = [
            r for r in range(world_size) if not any(store.check([f"{key}/{how}/{r}"]) for how in ("timed_out", "done"))
        ]
        raise EplError(
            f"{what} timed out on rank {rank}: ranks {late} did not arrive at torch.distributed.checkpoint's "
            "collectives (stuck, or no longer calling engine.save/load with the others)."
        ) from None
    store.set(f"{key}/done/{rank}", "1")
    return result


def _meet(engine: CheckpointedEngine, what: str, problem: Callable[[], str | None] | None = None) -> None:
    """Meet every rank at the collective call ``what`` before any of them acts, or raise on every rank: a rank that
    does not call it is named (:mod:`epl.runtime.collective_calls`), and so is rank 0's ``problem()`` (checked on
    rank 0; on every process when each runs alone)."""
    alone = _alone(engine)
    first = alone or engine.context.cluster.rank == 0
    agree_to_call(
        what,
        rank=0 if alone else engine.context.cluster.rank,
        world_size=1 if alone else engine.context.cluster.world_size,
        timeout=_timeout(engine),
        problem=problem() if problem is not None and first else None,
    )


def _save_error(target: Path, error: BaseException) -> EplError:
    """DCP's CheckpointException of a save as one EplError naming the first failing rank; a full disk says so and
    what is left (the previous checkpoint, untouched)."""
    failure = _checkpoint_error(f"engine.save could not write {target}", error)
    if "No space left on device" in str(failure):
        return EplError(
            f"{failure}. Nothing was committed: the previous checkpoint at {target}, if any, is intact and the "
            "partial files were deleted. Free space, or save to another file system."
        )
    return failure


def _checkpoint_error(what: str, error: BaseException) -> EplError:
    """DCP's CheckpointException (every failing rank's exception) as one EplError naming the first."""
    failures = getattr(error, "failures", {}) or {}
    if not failures:
        return EplError(f"{what}: {_first_line(error)}")
    rank, (first, _) = min(failures.items())
    return EplError(f"{what}: rank {rank}: {_first_line(first)}")


def _few(items: list[str], count: int = 5) -> str:
    return ", ".join(items[:count]) + (f" and {len(items) - count} more" if len(items) > count else "")


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def _max() -> Any:
    from epl.interfaces.communicator import ReduceOp

    return ReduceOp.MAX


def _wanted_states(
    engine: CheckpointedEngine, saved: dict[str, Any]
) -> list[tuple[tuple[nn.Parameter, str], list[str]]]:
    """For each (parameter, state name) this rank keeps: the checkpoint keys that hold it (whole, or pieces)."""
    optimizer = engine.optimizer
    if optimizer is None:
        return []
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    by_parameter: dict[str, dict[str, list[str]]] = {}  # "optim/<name>/<state>[/<piece>]", read once
    for key in saved:
        if key.startswith("optim/"):
            _, name, state_name, *_ = key.split("/")
            by_parameter.setdefault(name, {}).setdefault(state_name, []).append(key)
    result = []
    for name, param in engine.model.named_parameters():
        if id(param) not in in_optimizer:
            continue
        for state_name, keys in by_parameter.get(name, {}).items():
            result.append(((param, state_name), sorted(keys, key=_piece_index)))
    return result


def _restore_optimizer(
    optimizer: torch.optim.Optimizer,
    states: list[tuple[tuple[nn.Parameter, str], list[str]]],
    loaded: dict[str, Any],
    param_groups: list[dict[str, Any]] | None,
    device: torch.device,
) -> None:
    optimizer.state.clear()
    for (param, state_name), keys in states:
        if len(keys) == 1 and "/shard" not in keys[0]:
            read = loaded[keys[0]]
        else:  # format 2: a split parameter's pieces, made whole (one tensor at a time) and cut below
            piece, _, parts = keys[0].rsplit("dim", 1)[1].partition("parts")
            read = assemble([loaded[key] for key in keys], int(piece), int(parts or 1))
        holding = held(param)
        value = local_value(read, holding)
        if value.dim():
            value = value.to(device)
            if isinstance(read, Rectangles) or tuple(read.shape) == holding.shape:  # held as the parameter is
                value = placed_like(value, param)
        optimizer.state[param][state_name] = value
    if param_groups is not None:
        if len(param_groups) != len(optimizer.param_groups):
            raise EplError(
                f"The checkpoint's optimizer had {len(param_groups)} parameter groups, this one has "
                f"{len(optimizer.param_groups)}: build the optimizer with the same groups to resume."
            )
        for group, options in zip(optimizer.param_groups, param_groups, strict=True):
            group.update(options)


# -- helpers -----------------------------------------------------------------------------------
def _piece_index(key: str) -> int:
    tail = key.rsplit("/", 1)[-1]
    return int(tail[len("shard") :].split("of")[0]) if tail.startswith("shard") else 0


def _dtype(metadata: Any) -> torch.dtype:
    return metadata.properties.dtype


def _rng_state() -> dict[str, torch.Tensor]:
    """This process's generator states as tensors: torch's, Python's (as JSON), each CUDA device's."""
    state = {"torch": torch.get_rng_state(), "python": files.encode_json(random.getstate())}
    if torch.cuda.is_available():
        state["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = files.decode_json(state["python"])
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))


def _data_items(rank: int) -> dict[str, torch.Tensor]:
    """Where this rank's ``epl.io`` loaders stand, as the entry ``data/<rank>`` (none without loaders)."""
    from epl.io import positions

    states = positions.saved()
    return {f"data/{rank}": files.encode_json(states)} if states else {}


def _data_states(tensors: dict[str, torch.Tensor]) -> dict[int, list[dict[str, Any]]]:
    """The ``data/<rank>`` entries read: each saving rank's loader states."""
    entries = {key: value for key, value in tensors.items() if key.startswith("data/")}
    return {int(key.split("/")[1]): files.decode_json(value) for key, value in entries.items()}


def _data_problem(tensors: dict[str, torch.Tensor], strict: bool) -> str | None:
    """Why the checkpoint's loader positions cannot be resumed here (None: they can, or there are none)."""
    from epl.io import positions

    try:
        return positions.restore_problem(_data_states(tensors), strict)
    except (ValueError, TypeError, KeyError, UnicodeDecodeError) as error:
        return f"The checkpoint has an unreadable data/ entry (where its loaders stood): {error!r}."


def _restore_data_positions(tensors: dict[str, torch.Tensor], strict: bool) -> None:
    """Resume the ``epl.io`` loaders built so far where the checkpoint's stood; keep the others' positions for
    when they are built."""
    from epl.io import positions

    positions.restore(_data_states(tensors), strict)


def _alone(engine: CheckpointedEngine) -> bool:
    """Whether this job is one process (DCP then runs without torch.distributed)."""
    return engine.plan.local or engine.context.cluster.world_size == 1


@contextlib.contextmanager
def _quiet_when_alone(alone: bool) -> Iterator[None]:
    """Without DCP's warning that one process means no torch.distributed (that is the intent)."""
    if not alone:
        yield
        return
    # catch_warnings swaps the process's filters: a background save of a one-process job (the only caller
    # outside the main thread) may race another thread's catch_warnings, which can at worst show or hide a warning.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _require_default_group(engine: CheckpointedEngine) -> None:
    """DCP coordinates on torch.distributed's default process group: a job of several processes needs one."""
    import torch.distributed as dist

    if not _alone(engine) and not dist.is_initialized():
        raise EplError(
            "engine.save/load coordinate through torch.distributed's default process group, which this job "
            "does not have (communication.backend 'cupy'?). Use communication.backend 'auto' or 'torch'."
        )


def _replace(partial: Path, target: Path, *, keep_old: bool = False) -> None:
    """Put ``partial`` in ``target``'s place; the old checkpoint is removed only once the new one is there (or
    left at ``<target>.old`` with ``keep_old``, for :func:`_discard`). Only EPL's own files are ever deleted
    (:mod:`epl.runtime.checkpoint_folders`, which checked the folders before the save began)."""
    old = target.with_name(target.name + ".old")
    if target.exists():
        if not target.is_dir():
            raise EplError(f"{target} exists and is not a checkpoint directory; choose another path.")
        left = folders.remove_own(old, folders.is_checkpoint_file)
        if left:
            raise EplError(f"{old} holds {left}, which engine.save did not write; move them out and save again.")
        os.replace(target, old)
    # else: a save cut off between its two renames left the previous checkpoint at <target>.old: kept until now
    os.replace(partial, target)
    if not keep_old:
        folders.remove_own(old, folders.is_checkpoint_file)


def _discard(old: Path, rank: int) -> None:
    """Delete ``rank``'s data files of the previous checkpoint ``old``; rank 0 then deletes EPL's other files and the
    folder. Ranks delete at the same time: a file another rank removed first is skipped. Whatever engine.save did
    not write is left where it is."""
    try:  # rank 0 may have removed the whole folder already
        mine = [entry.name for entry in os.scandir(old) if fnmatch.fnmatchcase(entry.name, f"__{rank}_*.distcp")]
    except (FileNotFoundError, NotADirectoryError):
        mine = []
    for name in mine:
        with contextlib.suppress(FileNotFoundError):
            (old / name).unlink()
    if rank == 0:
        left = folders.remove_own(old, folders.is_checkpoint_file)
        if left:
            warnings.warn(f"{old} kept: it holds {left}, which engine.save did not write.", stacklevel=2)


def _readable(target: Path) -> Path:
    """``target``, or the previous checkpoint when a save was cut off between its two renames."""
    if (target / ".metadata").exists():
        return target
    old = target.with_name(target.name + ".old")
    if (old / ".metadata").exists():
        return old
    raise EplError(f"No EPL checkpoint at {target}: write one with engine.save(path) first.")


def read_model_state(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The model's whole tensors in a checkpoint directory, as the unsplit model's ``state_dict``.

    For use outside EPL (one process, no engine): ``model.load_state_dict(read_model_state(path))``.
    Every file is checked against its checksum first.
    """
    folder = _readable(Path(path))
    verification = _Verification(folder)
    with verification.blaming_damage():
        reader = files.safe_reader(folder)
        saved = reader.read_metadata().state_dict_metadata
        wanted = {key: _placeholder(meta) for key, meta in saved.items() if key.startswith("model/")}
        tensors, problem = _load(reader, wanted, folder)
    damaged, unchecked = verification.result()
    if damaged:
        raise verification.error(damaged)
    if unchecked or problem:
        raise EplError(unchecked or problem)
    return {key[len("model/") :]: tensors[key] for key in wanted}
