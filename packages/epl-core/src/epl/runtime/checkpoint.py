"""Checkpoints any layout can load: whole tensors under the unsplit model's names, written in parallel.

``Engine.save(path)`` writes a directory with ``torch.distributed.checkpoint`` (DCP):
every rank writes its own file at the same time, and a tensor several ranks hold
(a replicated weight) is written once. What is saved is *logical*, not per device:

- ``model/<name>``: each parameter and buffer whole (split shards gathered), under the
  name it has in the model the user wrote;
- ``optim/<name>/<state>``: the optimizer state of each parameter (Adam's ``exp_avg``...),
  whole, or as ``.../shard<i>of<n>dim<d>`` pieces for split parameters, written by
  whichever device keeps it (under ZeRO, the owner);
- ``engine/meta``: the step counter, the optimizer's hyperparameters, the loss scaler;
- ``rng/<rank>``: every rank's random number generator states.

``Engine.load(path)`` reads what this rank's layout needs, whatever layout saved it: a
pipeline stage reads its stage's names, a split device slices the whole tensors, a
ZeRO owner reads the states it owns. Writing goes to ``<path>.partial`` and is renamed
to ``<path>`` once every rank has finished, so a crash while saving leaves the previous
checkpoint intact.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from epl.errors import EplError
from epl.interfaces.optimizer_groups import group_options

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

    def state_dict(self, *, full: bool = False) -> dict[str, Any]:
        """The engine's state (``full``: whole tensors gathered from shards)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        ...


#: Identifies the layout of the directory.
FORMAT = "epl-checkpoint/1"
_PIECE = "shard{index}of{count}dim{dim}"
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
    with _quiet_when_alone(engine):
        dcp.save(items, checkpoint_id=str(partial), no_dist=_alone(engine))
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
    }
    items["engine/meta"] = _pickled(meta)
    items[f"rng/{engine.context.cluster.rank}"] = _pickled(_rng_state())
    return items


# -- loading -----------------------------------------------------------------------------------
def load_checkpoint(engine: CheckpointedEngine, path: str | os.PathLike[str]) -> None:
    """Restore what :func:`save_checkpoint` wrote, into ``engine``'s layout (every rank calls it)."""
    import torch.distributed.checkpoint as dcp

    _require_default_group(engine)
    folder = _readable(Path(path))
    saved = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    if "engine/meta" not in saved:
        raise EplError(f"{folder} is not an EPL checkpoint (no engine/meta); write one with engine.save(path).")
    device = engine.context.cluster.device
    local = engine.model.state_dict(keep_vars=True)
    missing = [key for key in local if f"model/{key}" not in saved]
    if missing:
        raise EplError(
            f"The checkpoint {folder} has no {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}: "
            "it was saved from a different model (the names are those of the model as written, before EPL)."
        )
    wanted: dict[str, Any] = {
        f"model/{key}": torch.empty(saved[f"model/{key}"].size, dtype=_dtype(saved[f"model/{key}"])) for key in local
    }
    wanted["engine/meta"] = io.BytesIO()
    rank_rng = f"rng/{engine.context.cluster.rank}"
    if rank_rng in saved:
        wanted[rank_rng] = io.BytesIO()
    states = _wanted_states(engine, saved)
    wanted.update({key: torch.empty(saved[key].size, dtype=_dtype(saved[key])) for _, keys in states for key in keys})
    with _quiet_when_alone(engine):
        dcp.load(wanted, checkpoint_id=str(folder), no_dist=_alone(engine))

    meta = _unpickled(wanted["engine/meta"])
    whole = {key: wanted[f"model/{key}"] for key in local}
    engine.load_state_dict(
        {"version": 1, "model": whole, "optimizer": None, "global_step": meta["global_step"], "shards": {}}
    )
    if engine.optimizer is not None:
        _restore_optimizer(engine.optimizer, states, wanted, meta["param_groups"], device)
    if engine.loss_scaler is not None and meta["loss_scaler"] is not None:
        engine.loss_scaler.load_state_dict(meta["loss_scaler"])
    if rank_rng in wanted:
        _set_rng_state(_unpickled(wanted[rank_rng]))


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


def _pickled(value: Any) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return buffer


def _unpickled(buffer: io.BytesIO) -> Any:
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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
    reader = dcp.FileSystemReader(str(folder))
    saved = reader.read_metadata().state_dict_metadata
    wanted = {
        key: torch.empty(meta.size, dtype=_dtype(meta)) for key, meta in saved.items() if key.startswith("model/")
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(wanted, storage_reader=reader, no_dist=True)
    return {key[len("model/") :]: value for key, value in wanted.items()}
