"""Loading: each rank reads what its layout needs, whatever layout saved it, after every rank agreed.

Loading never runs code from the checkpoint and checks it first (:mod:`epl.runtime.checkpoint.files`): every file
against its recorded checksum, then, strictly by default, that the names, shapes and dtypes are the model's and the
optimizer is of the same kind. Every rank agrees before anything is loaded (one all-reduce), so a refused
checkpoint is one error on every rank, not a hang. Each rank reads what it needs on its own (DCP's load needs no
collective for that).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from epl.errors import EplError
from epl.interfaces.optimizer_groups import group_options
from epl.runtime import agreement
from epl.runtime.checkpoint import files, folders
from epl.runtime.checkpoint.background import wait_for_background_save
from epl.runtime.checkpoint.chunks import Rectangles, local_value, to_read
from epl.runtime.checkpoint.common import CheckpointedEngine, few, first_line
from epl.runtime.checkpoint.data import data_problem, restore_data_positions
from epl.runtime.checkpoint.keys import (
    META,
    READABLE,
    StateKey,
    is_data,
    is_state,
    model_key,
    model_name,
    rng_generator,
)
from epl.runtime.checkpoint.meeting import agree, alone, meet, quiet_when_alone, require_default_group
from epl.runtime.checkpoint.rng import restore_rng
from epl.sharding.chunks import held, placed_like
from epl.sharding.parameters import assemble, shard_spec

#: Options an LR scheduler adds to the optimizer's groups: not part of the optimizer's kind.
_SCHEDULER_OPTIONS = frozenset({"initial_lr"})


def load_checkpoint(engine: CheckpointedEngine, path: str | os.PathLike[str], *, strict: bool = True) -> None:
    """Restore what :func:`save_checkpoint` wrote, into ``engine``'s layout (every rank calls it).

    ``strict`` (default): the checkpoint must hold exactly the model's tensors, with their shapes and
    dtypes, and an optimizer of the same kind. ``strict=False`` loads what matches: extra tensors are
    ignored, missing ones keep their values, dtypes are converted, and the optimizer state is
    skipped when the optimizer differs. Shapes must match either way.
    """
    require_default_group(engine)
    wait_for_background_save()
    meet(engine, "engine.load")
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
            "version": engine.STATE_VERSION,
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
    restore_rng(read.tensors, engine.context.cluster.rank)
    restore_data_positions(read.tensors, strict)


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
    ranks, the rank that found it), and nothing was applied on any rank (:func:`.meeting.agree`: one all-reduce
    when every rank succeeded)."""
    from torch.distributed.checkpoint.api import CheckpointException

    cluster, several = engine.context.cluster, not alone(engine)
    verification: _Verification | None = None
    found: _Read | None = None
    names: list[str] = []
    held: list[bool] = []
    problem: str | None = None
    try:
        folder = folders.readable(path)
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
    agree(engine, problem, weight)
    assert found is not None
    if several and names:
        flags = torch.tensor(held, dtype=torch.int64)
        engine.context.communicator.all_reduce(flags, _max()).wait()
        held = [bool(flag) for flag in flags.tolist()]
    extra = [name for name, here in zip(names, held, strict=True) if not here]
    if extra:
        raise EplError(
            f"The checkpoint has tensors the model does not: {few(extra)}. Load it into the model it was saved "
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
    meta_entry = saved.get(META)
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
    names = sorted(name for key in saved if (name := model_name(key)) is not None) if strict else []
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
    # engine/meta, this rank's generators, and every rank's data/ (each rank's loader positions are checked)
    plain = [META, *(key for key in saved if rng_generator(key, rank) is not None or is_data(key))]
    wanted.update({key: _placeholder(saved[key]) for key in plain})
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {}
    optimizer_problem = None
    if problem is None:
        tensors, problem = _load(reader, wanted, folder)
    if problem is None:
        meta, problem = _decoded_meta(tensors[META], folder)
    if problem is None:
        optimizer_problem = _optimizer_problem(engine, meta)
        if strict:
            problem = optimizer_problem or _scheduler_problem(engine, meta)
    if problem is None:
        problem = data_problem(tensors, strict)
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
    absent = [key for key in local if model_key(key) not in saved]
    keys = {key: model_key(key) for key in local if key not in absent}
    shapes, dtypes = [], []
    for key, item in keys.items():
        tensor, whole = local[key], list(holdings[key].shape)
        if list(saved[item].size) != whole:
            shapes.append(f"{key} {list(saved[item].size)} (the model's {whole})")
        if _dtype(saved[item]) != tensor.dtype:
            dtypes.append(f"{key} {_dtype(saved[item])} (the model's {tensor.dtype})")
    fix = " Load it into the model it was saved from, or pass strict=False to load what matches."
    if shapes:
        return f"The checkpoint's tensors have other shapes than the model's: {few(shapes)}.", keys
    if strict and absent:
        return (
            f"The checkpoint has no {few(absent)}: it was saved from a different model (the names are those of the "
            f"model as written, before EPL).{fix}",
            keys,
        )
    if strict and dtypes:
        return f"The checkpoint's tensors have other dtypes than the model's: {few(dtypes)}.{fix}", keys
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
        with quiet_when_alone(True):
            dcp.load(wanted, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - any failure to read is a refusal, agreed
        return {}, f"Cannot load the checkpoint {folder}: {first_line(_cause(error))}"
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
    if meta.get("format") not in READABLE:
        return {}, (
            f"The checkpoint {folder} is in the format {meta.get('format')!r}; this EPL reads {list(READABLE)}. "
            "Load it with the EPL that wrote it."
        )
    return meta, None


def _placeholder(metadata: Any) -> torch.Tensor:
    """A tensor of the entry's shape and dtype for DCP's planner, never written (so its pages are never touched):
    the reader keeps the tensor it reads instead. (DCP turns ``meta`` tensors into tensors on the default
    process group's device.)"""
    return torch.empty(metadata.size, dtype=_dtype(metadata))


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
        if is_state(key):
            parsed = StateKey.parse(key)
            by_parameter.setdefault(parsed.param, {}).setdefault(parsed.state, []).append(key)
    result = []
    for name, param in engine.model.named_parameters():
        if id(param) not in in_optimizer:
            continue
        for state_name, keys in by_parameter.get(name, {}).items():
            result.append(((param, state_name), sorted(keys, key=lambda key: StateKey.parse(key).order)))
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
        piece = StateKey.parse(keys[0]).piece
        if len(keys) == 1 and piece is None:
            read = loaded[keys[0]]
        else:  # format 2: a split parameter's pieces, made whole (one tensor at a time) and cut below
            assert piece is not None
            read = assemble([loaded[key] for key in keys], piece.dim, piece.parts or 1)
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


def _dtype(metadata: Any) -> torch.dtype:
    dtype: torch.dtype = metadata.properties.dtype
    return dtype


def read_model_state(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The model's whole tensors in a checkpoint directory, as the unsplit model's ``state_dict``.

    For use outside EPL (one process, no engine): ``model.load_state_dict(read_model_state(path))``.
    Every file is checked against its checksum first.
    """
    folder = folders.readable(Path(path))
    verification = _Verification(folder)
    with verification.blaming_damage():
        reader = files.safe_reader(folder)
        saved = reader.read_metadata().state_dict_metadata
        wanted = {key: _placeholder(meta) for key, meta in saved.items() if model_name(key) is not None}
        tensors, problem = _load(reader, wanted, folder)
    damaged, unchecked = verification.result()
    if damaged:
        raise verification.error(damaged)
    if unchecked or problem:
        raise EplError(unchecked or problem)
    return {name: tensors[key] for key in wanted if (name := model_name(key)) is not None}
