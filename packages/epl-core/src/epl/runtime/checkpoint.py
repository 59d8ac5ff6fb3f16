"""Checkpoints any layout can load: whole tensors under the unsplit model's names, written in parallel.

``Engine.save(path)`` writes a directory with ``torch.distributed.checkpoint`` (DCP):
every rank writes its own file at the same time, and a tensor several ranks hold
(a replicated weight) is written once. What is saved is *logical*, not per device:

- ``model/<name>``: each parameter and buffer whole (split shards gathered), under the
  name it has in the model the user wrote;
- ``optim/<name>/<state>``: the optimizer state of each parameter (Adam's ``exp_avg``...),
  whole, or as ``.../shard<i>of<n>dim<d>`` pieces for split parameters, written by
  whichever device keeps it (under ZeRO, the owner);
- ``engine/meta``: the step counter, the optimizer's hyperparameters, the loss scaler (JSON
  text in a uint8 tensor: nothing in a checkpoint is pickled by EPL);
- ``rng/<rank>/<generator>``: every rank's random number generator states.

``Engine.load(path)`` reads what this rank's layout needs, whatever layout saved it: a
pipeline stage reads its stage's names, a split device slices the whole tensors, a
ZeRO owner reads the states it owns. Writing goes to ``<path>.partial`` and is renamed
to ``<path>`` once every rank has finished, so a crash while saving leaves the previous
checkpoint intact.

Loading never runs code from the checkpoint and checks it first (:mod:`epl.runtime.checkpoint_files`):
every file against its recorded checksum, then, strictly by default, that the names,
shapes and dtypes are the model's and the optimizer is of the same kind. Every rank agrees
before anything is loaded, so a refused checkpoint is one error on every rank, not a hang.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from epl.errors import EplError
from epl.interfaces.optimizer_groups import group_options
from epl.runtime import checkpoint_files as files

if TYPE_CHECKING:
    from epl.placement.plan import Plan
    from epl.plugins.context import LossScaler, ParallelContext


class CheckpointedEngine(Protocol):
    """What saving and loading read and restore of :class:`epl.runtime.engine.Engine` (which calls them)."""

    global_step: int
    context: ParallelContext

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


#: Identifies the layout of the directory.
FORMAT = "epl-checkpoint/2"
_PIECE = "shard{index}of{count}dim{dim}"
#: Options an LR scheduler adds to the optimizer's groups: not part of the optimizer's kind.
_SCHEDULER_OPTIONS = {"initial_lr"}
_PARTS = "parts{parts}"  # appended for shards of fused tensors (ShardSpec.parts > 1)


# -- saving ------------------------------------------------------------------------------------
def save_checkpoint(engine: CheckpointedEngine, path: str | os.PathLike[str]) -> None:
    """Write ``engine``'s logical state to the directory ``path`` (a collective: every rank calls it)."""
    import torch.distributed.checkpoint as dcp

    _require_default_group(engine)
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    items = _logical_items(engine)
    _everyone(engine, lambda: _remove(partial))
    writer = files.checksumming_writer(partial)
    with _quiet_when_alone(engine):
        _named_when_late(engine, "engine.save", lambda: dcp.save(items, storage_writer=writer, no_dist=_alone(engine)))
    rank = engine.context.cluster.rank
    files.write_checksums(partial, rank, files.written_by(partial, rank), writer.written_checksums)
    _everyone(engine, lambda: _replace(partial, target))


def _logical_items(engine: CheckpointedEngine) -> dict[str, Any]:
    from epl.sharding.parameters import shard_spec

    items: dict[str, Any] = {f"model/{k}": v for k, v in engine.state_dict(full=True)["model"].items()}
    optimizer = engine.optimizer
    if optimizer is not None:
        holds = getattr(optimizer, "holds_state", lambda param: True)
        for name, param in engine.model.named_parameters():
            state = optimizer.state.get(param)
            if not state or not holds(param):
                continue
            spec = shard_spec(param)
            for key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    continue
                item = f"optim/{name}/{key}"
                if spec is not None and value.shape == param.shape:
                    item += "/" + _PIECE.format(index=spec.group.index, count=spec.group.count, dim=spec.dim)
                    item += _PARTS.format(parts=spec.parts) if spec.parts > 1 else ""
                items[item] = value
    scaler = engine.loss_scaler
    meta = {
        "format": FORMAT,
        "global_step": engine.global_step,
        "param_groups": [group_options(group) for group in optimizer.param_groups] if optimizer is not None else None,
        "loss_scaler": scaler.state_dict() if scaler is not None else None,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
    }
    items["engine/meta"] = files.encode_json(meta)
    items.update({f"rng/{engine.context.cluster.rank}/{k}": v for k, v in _rng_state().items()})
    return items


# -- loading -----------------------------------------------------------------------------------
def load_checkpoint(engine: CheckpointedEngine, path: str | os.PathLike[str], *, strict: bool = True) -> None:
    """Restore what :func:`save_checkpoint` wrote, into ``engine``'s layout (every rank calls it).

    ``strict`` (default): the checkpoint must hold exactly the model's tensors, with their shapes and
    dtypes, and an optimizer of the same kind. ``strict=False`` loads what matches: extra tensors are
    ignored, missing ones keep their values, dtypes are converted, and the optimizer state is
    skipped when the optimizer differs. Shapes must match either way.
    """
    import torch.distributed.checkpoint as dcp

    _require_default_group(engine)
    folder = _readable(Path(path))
    with _verified(folder, engine):  # nothing read is applied before the files are known to be intact
        read = _read(engine, dcp, folder, strict)
    current = engine.state_dict(full=True)["model"] if not strict else {}  # what missing tensors keep
    whole = {key: read.tensors[item] for key, item in read.model_keys.items()}
    whole.update({key: value for key, value in current.items() if key not in whole})
    meta = read.meta
    engine.load_state_dict(
        {"version": 1, "model": whole, "optimizer": None, "global_step": meta["global_step"], "shards": {}}
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


def _read(engine: CheckpointedEngine, dcp: Any, folder: Path, strict: bool) -> _Read:
    """Check the checkpoint against ``engine`` (every rank agrees) and read what this rank needs into tensors of
    its own."""
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
    problem, keys = _model_problems(engine, saved, local, strict)
    _agree(engine, problem)
    wanted: dict[str, Any] = {key: torch.empty(saved[key].size, dtype=_dtype(saved[key])) for key in keys.values()}
    wanted["engine/meta"] = torch.empty(meta_entry.size, dtype=torch.uint8)
    rank_rng = {key: value for key, value in saved.items() if key.startswith(f"rng/{engine.context.cluster.rank}/")}
    wanted.update({key: torch.empty(value.size, dtype=_dtype(value)) for key, value in rank_rng.items()})
    states = _wanted_states(engine, saved)
    wanted.update({key: torch.empty(saved[key].size, dtype=_dtype(saved[key])) for _, ks in states for key in ks})
    _load(
        engine, dcp, wanted, reader, folder
    )  # one read of everything, into tensors of its own: nothing is applied yet
    meta = files.decode_json(wanted["engine/meta"])
    optimizer_problem = _optimizer_problem(engine, meta)
    scheduler_problem = None
    if engine.lr_scheduler is not None and meta.get("lr_scheduler") is None:
        scheduler_problem = (
            "The checkpoint has no LR scheduler state, but this engine has an LR scheduler: it would restart its "
            "schedule. Save from an engine with the same scheduler, or pass strict=False to keep the scheduler as "
            "it is."
        )
    _agree(engine, (optimizer_problem or scheduler_problem) if strict else None)
    return _Read(wanted, keys, [] if optimizer_problem is not None else states, meta, optimizer_problem)


@contextlib.contextmanager
def _verified(folder: Path, engine: CheckpointedEngine | None = None) -> Iterator[None]:
    """Check every file of ``folder`` against its recorded checksum while the block reads them (hashing releases
    the GIL); the files are shared out over ``engine``'s ranks (None: this process checks them all). At the end
    every rank agrees, and one error on every rank names the first damaged file; when the block fails, a damaged
    file found here is the error reported. Nothing read in the block may be applied before it ends."""
    sums = files.recorded_checksums(folder)
    names = sorted(sums)
    several = engine is not None and not _alone(engine)
    rank, world = (engine.context.cluster.rank, engine.context.cluster.world_size) if several else (0, 1)
    outcome: list[str | None | BaseException] = []

    def verify() -> None:
        try:
            outcome.append(files.first_damaged(folder, names[rank::world], sums))
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
            outcome.append(error)

    thread = threading.Thread(target=verify, name="epl-checkpoint-verify", daemon=True)
    thread.start()
    try:
        yield
    except BaseException:
        thread.join()
        if outcome and isinstance(outcome[0], str):
            raise files.damaged_file_error(folder, outcome[0], sums) from None
        raise
    thread.join()
    if isinstance(outcome[0], BaseException):
        raise EplError(f"Cannot check the checkpoint {folder}: {outcome[0]}") from outcome[0]
    damaged = outcome[0]
    flag = torch.tensor([names.index(damaged) + 1 if damaged is not None else 0], dtype=torch.int64)
    if several:
        assert engine is not None
        engine.context.communicator.all_reduce(flag, _max()).wait()
    if int(flag):
        raise files.damaged_file_error(folder, names[int(flag) - 1], sums)


def _model_problems(
    engine: CheckpointedEngine, saved: dict[str, Any], local: dict[str, torch.Tensor], strict: bool
) -> tuple[str | None, dict[str, str]]:
    """What keeps the checkpoint's model tensors from loading into this rank's (None: nothing), and the checkpoint
    key of each local tensor to load."""
    from epl.sharding.parameters import shard_spec

    absent = [key for key in local if f"model/{key}" not in saved]
    keys = {key: f"model/{key}" for key in local if key not in absent}
    shapes, dtypes = [], []
    for key, item in keys.items():
        tensor, spec = local[key], shard_spec(local[key])
        whole = list(tensor.shape)
        if spec is not None:
            whole[spec.dim] = spec.size
        if list(saved[item].size) != whole:
            shapes.append(f"{key} {list(saved[item].size)} (the model's {whole})")
        if _dtype(saved[item]) != tensor.dtype:
            dtypes.append(f"{key} {_dtype(saved[item])} (the model's {tensor.dtype})")
    extra = _extra_model_keys(engine, saved, local) if strict else []  # strict is the same on every rank
    fix = " Load it into the model it was saved from, or pass strict=False to load what matches."
    if shapes:
        return f"The checkpoint's tensors have other shapes than the model's: {_few(shapes)}.", keys
    if strict and absent:
        return (
            f"The checkpoint has no {_few(absent)}: it was saved from a different model (the names are those of the "
            f"model as written, before EPL).{fix}",
            keys,
        )
    if strict and extra:
        return f"The checkpoint has tensors the model does not: {_few(extra)}.{fix}", keys
    if strict and dtypes:
        return f"The checkpoint's tensors have other dtypes than the model's: {_few(dtypes)}.{fix}", keys
    return None, keys


def _extra_model_keys(engine: CheckpointedEngine, saved: dict[str, Any], local: dict[str, Any]) -> list[str]:
    """The checkpoint's model tensors that no rank's model has (each rank may hold only its stage)."""
    names = sorted(key[len("model/") :] for key in saved if key.startswith("model/"))
    held = torch.tensor([name in local for name in names], dtype=torch.int64)
    if not _alone(engine) and names:
        engine.context.communicator.all_reduce(held, _max()).wait()
    return [name for name, here in zip(names, held.tolist(), strict=True) if not here]


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


def _agree(engine: CheckpointedEngine, problem: str | None) -> None:
    """Raise ``problem`` on this rank and an error naming the refusing rank on every other (a collective)."""
    flag = torch.tensor([engine.context.cluster.rank + 1 if problem else 0], dtype=torch.int64)
    if not _alone(engine):
        engine.context.communicator.all_reduce(flag, _max()).wait()
    if problem:
        raise EplError(problem)
    if int(flag):
        raise EplError(f"Rank {int(flag) - 1} refused the checkpoint (its error says why); nothing was loaded.")


def _load(engine: CheckpointedEngine, dcp: Any, wanted: dict[str, Any], reader: Any, folder: Path) -> None:
    """DCP's load of ``wanted`` from ``folder`` through ``reader`` (:func:`files.safe_reader`), its failures as
    :class:`EplError`."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _quiet_when_alone(engine):
            _named_when_late(
                engine,
                "engine.load",
                lambda: dcp.load(wanted, storage_reader=reader, no_dist=_alone(engine)),
            )
    except (CheckpointException, OSError, RuntimeError, ValueError) as error:
        raise EplError(f"Cannot load the checkpoint {folder}: {_first_line(error)}") from None


_calls = itertools.count()
#: Seconds a rank whose checkpoint collective timed out waits for the other waiting ranks to say so.
_LATE_SETTLE_SECONDS = 2.0


def _named_when_late(engine: CheckpointedEngine, what: str, action: Callable[[], Any]) -> Any:
    """Run ``action`` (torch.distributed.checkpoint's collectives); when it times out, name the ranks that never
    finished it nor timed out themselves (the late ones), as EPL's own collectives do.

    Every rank records in the job's store that it finished, or that it timed out; the ranks with neither did not
    arrive.
    """
    import torch.distributed as dist

    if _alone(engine):
        return action()
    key = f"epl/checkpoint/{next(_calls)}"
    rank, world = engine.context.cluster.rank, engine.context.cluster.world_size
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
        late = [r for r in range(world) if not any(store.check([f"{key}/{how}/{r}"]) for how in ("timed_out", "done"))]
        raise EplError(
            f"{what} timed out on rank {rank}: ranks {late} did not arrive at torch.distributed.checkpoint's "
            "collectives (stuck, or no longer calling engine.save/load with the others)."
        ) from None
    store.set(f"{key}/done/{rank}", "1")
    return result


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
    holds = getattr(optimizer, "holds_state", lambda param: True)
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    by_parameter: dict[str, dict[str, list[str]]] = {}  # "optim/<name>/<state>[/<piece>]", read once
    for key in saved:
        if key.startswith("optim/"):
            _, name, state_name, *_ = key.split("/")
            by_parameter.setdefault(name, {}).setdefault(state_name, []).append(key)
    result = []
    for name, param in engine.model.named_parameters():
        if id(param) not in in_optimizer or not holds(param):
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
    from epl.sharding.parameters import assemble, shard_spec

    optimizer.state.clear()
    for (param, state_name), keys in states:
        if len(keys) == 1 and "/shard" not in keys[0]:
            value = loaded[keys[0]]
        else:
            piece, _, parts = keys[0].rsplit("dim", 1)[1].partition("parts")
            value = assemble([loaded[key] for key in keys], int(piece), int(parts or 1))
        spec = shard_spec(param)
        if spec is not None and value.dim() and value.shape[spec.dim] == spec.size:
            value = spec.slice_of(value).clone()
        if value.dim():
            value = value.to(device)
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


def _alone(engine: CheckpointedEngine) -> bool:
    """Whether this job is one process (DCP then runs without torch.distributed)."""
    return engine.plan.local or engine.context.cluster.world_size == 1


@contextlib.contextmanager
def _quiet_when_alone(engine: CheckpointedEngine) -> Iterator[None]:
    """Without DCP's warning that one process means no torch.distributed (that is the intent)."""
    with warnings.catch_warnings():
        if _alone(engine):
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


def _everyone(engine: CheckpointedEngine, action: Callable[[], None]) -> None:
    """Run ``action`` on rank 0 between two barriers of the whole job."""
    several = not _alone(engine)
    if several:
        engine.context.communicator.barrier().wait()
    if engine.context.cluster.rank == 0:
        action()
    if several:
        engine.context.communicator.barrier().wait()


def _remove(folder: Path) -> None:
    if folder.exists():
        shutil.rmtree(folder)


def _replace(partial: Path, target: Path) -> None:
    """Put ``partial`` in ``target``'s place; the old checkpoint is removed only once the new one is there."""
    old = target.with_name(target.name + ".old")
    _remove(old)
    if target.exists():
        if not target.is_dir():
            raise EplError(f"{target} exists and is not a checkpoint directory; choose another path.")
        os.replace(target, old)
    os.replace(partial, target)
    _remove(old)


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
    """
    import torch.distributed.checkpoint as dcp

    folder = _readable(Path(path))
    with _verified(folder), warnings.catch_warnings():
        reader = files.safe_reader(folder)
        saved = reader.read_metadata().state_dict_metadata
        wanted = {
            key: torch.empty(meta.size, dtype=_dtype(meta)) for key, meta in saved.items() if key.startswith("model/")
        }
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(wanted, storage_reader=reader, no_dist=True)
    return {key[len("model/") :]: value for key, value in wanted.items()}
