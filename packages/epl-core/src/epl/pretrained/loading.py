"""Reading this rank's slices of a transformers checkpoint folder into an engine's model."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from epl.errors import EplError
from epl.pretrained.conversion import conversions
from epl.pretrained.pieces import _ITEMSIZE, INDEX, SINGLE, Piece, local_tensors, read
from epl.pretrained.wrapped import base_names, unwrapped
from epl.runtime.checkpoint.files import unreadable_file_error
from epl.runtime.checkpoint.meeting import agree, alone
from epl.sharding.chunks import placed_like

if TYPE_CHECKING:
    from epl.runtime.checkpoint.common import CheckpointedEngine

_log = logging.getLogger(__name__)


def checkpoint_files(folder: Path) -> dict[str, Path]:
    """Each tensor name of the transformers checkpoint ``folder`` -> the safetensors file holding it (every file
    the index names is there). A file that cannot be read is an :class:`EplError` naming it."""
    if not folder.is_dir():
        raise EplError(f"{folder} is not a folder; load_pretrained takes a transformers checkpoint folder.")
    if (folder / INDEX).exists():
        return _indexed(folder)
    if (folder / SINGLE).exists():
        from safetensors import safe_open

        try:
            with safe_open(str(folder / SINGLE), framework="pt") as handle:
                return dict.fromkeys(handle.keys(), folder / SINGLE)
        except Exception as error:  # noqa: BLE001 - safetensors' errors do not name the file
            raise unreadable_file_error(folder / SINGLE, error) from None
    pickled = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    if pickled:
        raise EplError(
            f"{folder} holds {pickled[0]}, a pickle-based checkpoint: loading it runs code from the file, so EPL "
            "does not read it. Convert it once where you trust it: transformers' "
            "Model.from_pretrained(folder).save_pretrained(out) writes safetensors (model.safetensors)."
        )
    raise EplError(f"{folder} holds neither {SINGLE} nor {INDEX}; is it a transformers checkpoint folder?")


def _indexed(folder: Path) -> dict[str, Path]:
    """The weight map of ``folder``'s index (transformers' ``model.safetensors.index.json``), checked: JSON, a map of
    names to file names, and every file it names there."""
    index_path = folder / INDEX
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError) as error:  # ValueError: JSON's errors, and text that is not UTF-8
        raise EplError(
            f"Cannot read the index {index_path} ({type(error).__name__}: {error}): it is damaged or not "
            "transformers' index. Copy the checkpoint folder again, or write it again with save_pretrained."
        ) from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(name, str) and isinstance(file, str) for name, file in weight_map.items()
    ):
        raise EplError(
            f"The index {index_path} has no weight_map of tensor names to file names, as transformers writes it: "
            "copy the checkpoint folder again, or write it again with save_pretrained."
        )
    files = {name: folder / file for name, file in weight_map.items()}
    absent = sorted({path.name for path in files.values() if not path.is_file()})
    if absent:
        more = f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""
        raise EplError(
            f"The index {index_path} names {folder / absent[0]}{more}, which is not there: the folder is incomplete "
            "(an interrupted download or copy?). Copy the missing files into it. Nothing was loaded."
        )
    return files


def name_map(model_names: list[str], saved: set[str]) -> dict[str, str]:
    """The model's name -> the checkpoint's name: the same, or the same under a prefix one side has and the other
    lacks (a ``LlamaModel`` checkpoint in a ``LlamaForCausalLM``, whose names start with ``model.``, or a model
    wrapped in one of the user's own modules); the prefix that matches the most names wins."""
    best: tuple[int, dict[str, str]] = (sum(name in saved for name in model_names), {n: n for n in model_names})
    prefixes = {name[: i + 1] for name in [*model_names, *saved] for i, c in enumerate(name) if c == "."}
    for prefix in sorted(prefixes):
        strip = {n: n[len(prefix) :] for n in model_names if n.startswith(prefix)}
        add = {n: prefix + n for n in model_names}
        for mapping in (strip, add):
            hits = sum(m in saved for m in mapping.values())
            if hits > best[0]:
                best = (hits, {n: mapping.get(n, n) for n in model_names})
    return best[1]


def load_pretrained(engine: CheckpointedEngine, path: str | os.PathLike[str], *, strict: bool = True) -> int:
    """Read this rank's part of the transformers checkpoint folder ``path`` into ``engine``'s model (a collective:
    every rank calls it). Returns the bytes of the slices this rank read.

    A file that cannot be read (a damaged index, a truncated or corrupt safetensors file, a shard the index names
    and the folder lacks) is one :class:`EplError` on every rank, naming the file: the ranks agree on the outcome
    of what each read alone (:func:`epl.runtime.checkpoint.meeting.agree`) before anything is applied, so after the
    error every rank holds the weights it had, and can load another folder.
    """
    folder = Path(path)
    problem: str | None = None
    try:
        files = checkpoint_files(folder)
    except Exception as error:  # noqa: BLE001 - every rank's outcome is agreed: an error on every rank
        files, problem = {}, _problem(folder, error)
    agree(engine, problem)
    held = list(local_tensors(engine))
    # A wrapped model (PEFT's): each tensor under its base model's name; an adapter's tensors are not in the folder.
    base = base_names(engine.model, [name for name, *_ in held])
    local = [(name, tensor, piece) for name, tensor, piece in held if base[name] is not None]
    adapters = [name for name, *_ in held if base[name] is None]
    tied = _tied_names(engine, base)
    # Each name of this rank's and the names tied to it: a checkpoint holds one name of a tied tensor.
    candidates = {name: [base_name, *tied.get(base_name, ())] for name, *_ in local if (base_name := base[name])}
    names = name_map(list(dict.fromkeys(n for group in candidates.values() for n in group)), set(files))
    sources = {name: next((names[n] for n in group if names[n] in files), None) for name, group in candidates.items()}
    # Names transformers renames or builds from several tensors at load (Mixtral's experts stored one by one).
    unresolved = {base_name: name for name, s in sources.items() if s is None and (base_name := base[name])}
    renamed, by_base = conversions(unwrapped(engine.model), sorted(files), set(unresolved))
    converted = {unresolved[b]: entry for b, entry in by_base.items()}
    sources.update({unresolved[b]: s for b, s in renamed.items() if sources.get(unresolved[b]) is None})
    missing = [name for name, source in sources.items() if source is None and name not in converted]
    mine = {names[n] for group in candidates.values() for n in group} | set(renamed.values())
    mine.update(source for entry in converted.values() for source in entry.names())
    unexpected = _held_by_no_rank(engine, sorted(files), mine)
    if strict and (missing or unexpected):
        problem = (
            f"{folder} does not fit the model: missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}. Load the checkpoint of this "
            "model's class and config. strict=False loads only the tensors that match: the missing ones keep their "
            "initial (random) values, which is right only for layers you mean to train from scratch."
        )
    agree(engine, problem)
    if not strict and (missing or unexpected):
        _log.warning(
            "load_pretrained(%s, strict=False) did not load %d of the model's tensors on rank %d, which keep their "
            "initial values: %s%s; %d of the checkpoint's tensors have no place in the model: %s%s",
            folder, len(missing), _rank(engine), missing[:5], " ..." if len(missing) > 5 else "",
            len(unexpected), unexpected[:5], " ..." if len(unexpected) > 5 else "",
        )  # fmt: skip
    if adapters:
        _log.info(
            "load_pretrained(%s): %d adapter tensors on rank %d keep their initialisation (%s ...)",
            folder, len(adapters), _rank(engine), adapters[0],
        )  # fmt: skip
    reader = _Reader(files)
    values: dict[str, torch.Tensor] = {}
    try:
        for name, tensor, piece in local:
            expected = piece.shape
            if name in converted and sources[name] is None:
                value = converted[name].read(base[name] or name, piece, reader.read)
                if tuple(value.shape) != piece.local_shape:
                    problem = f"{name!r} converted from {folder} has shape {list(value.shape)}, this rank's is " + (
                        f"{list(piece.local_shape)}."
                    )
                    break
                values[name] = placed_like(value.to(tensor.dtype), tensor)
                continue
            source = sources[name]
            if source is None:
                continue
            whole = reader.shape(source)
            if whole != expected:
                where = files[source].name
                problem = f"{source!r} has shape {list(whole)} in {where}, the model's is {list(expected)}."
                break
            values[name] = placed_like(reader.read(source, piece).to(tensor.dtype), tensor)
    except Exception as error:  # noqa: BLE001 - what a rank reads alone fails on every rank (agreed), named
        problem = _problem(folder, error)
    finally:
        reader.close()
    agree(engine, problem)  # only now is anything applied: after a refusal no rank holds half a load
    current = engine.state_dict()["model"]
    current.update(values)
    engine.load_state_dict(
        {"version": engine.STATE_VERSION, "model": current, "optimizer": None, "global_step": engine.global_step}
    )
    return reader.bytes_read


def _rank(engine: CheckpointedEngine) -> int:
    return 0 if alone(engine) else engine.context.cluster.rank


def _problem(folder: Path, error: Exception) -> str:
    """``error`` of loading ``folder`` as one rank's refusal: EPL's own as it is, another named."""
    if isinstance(error, EplError):
        return str(error)
    return f"Cannot load {folder}: {type(error).__name__}: {error}"


class _Reader:
    """Slices of the checkpoint's tensors, each file opened once, counting the bytes read; a file that cannot be read
    is an :class:`EplError` naming it."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files
        self.handles: dict[Path, Any] = {}
        self.bytes_read = 0

    def _view(self, name: str) -> Any:
        from safetensors import safe_open

        file = self.files[name]
        try:
            if file not in self.handles:
                self.handles[file] = safe_open(str(file), framework="pt")
            return self.handles[file].get_slice(name)
        except Exception as error:  # noqa: BLE001 - safetensors' errors do not name the file
            raise unreadable_file_error(file, error) from None

    def shape(self, name: str) -> tuple[int, ...]:
        """The whole shape of the checkpoint's tensor ``name``."""
        return tuple(self._view(name).get_shape())

    def read(self, name: str, piece: Piece | None) -> torch.Tensor:
        """The ``piece`` (None: all) of the checkpoint's tensor ``name``, in its stored dtype."""
        view = self._view(name)
        try:
            value = read(view, piece)
        except Exception as error:  # noqa: BLE001 - named, as above
            raise unreadable_file_error(self.files[name], error) from None
        self.bytes_read += value.numel() * _ITEMSIZE[view.get_dtype()]
        return value

    def close(self) -> None:
        self.handles.clear()


def _tied_names(engine: CheckpointedEngine, base: dict[str, str | None]) -> dict[str, list[str]]:
    """Each base name (``base``: the model's name -> its base model's) of this rank's model -> the other names of
    the same tensor (tied weights): one object under several names here, or a tie transformers declares
    (``get_expanded_tied_weights_keys``: the LM head's weight is the embedding's, on another pipeline stage), whose
    checkpoints hold one of the names only."""
    groups: dict[int, list[str]] = {}
    for name, tensor in engine.model.state_dict(keep_vars=True).items():
        base_name = base.get(name)
        if base_name is not None:
            groups.setdefault(id(tensor), []).append(base_name)
    tied = {name: [other for other in group if other != name] for group in groups.values() for name in group}
    declared = getattr(unwrapped(engine.model), "get_expanded_tied_weights_keys", None)
    if callable(declared):
        for target, source in declared(all_submodels=True).items():
            tied.setdefault(target, []).append(source)
            tied.setdefault(source, []).append(target)
    return tied


def _held_by_no_rank(engine: CheckpointedEngine, saved: list[str], mine: set[str]) -> list[str]:
    """The checkpoint's names (``saved``, the same list on every rank) that no rank's model holds (a pipeline
    rank holds its stage's names only): one all-reduce of a flag per name."""
    held = torch.tensor([name in mine for name in saved], dtype=torch.int64)
    if not alone(engine) and held.numel():
        engine.context.communicator.all_reduce(held).wait()
    return [name for name, count in zip(saved, held.tolist(), strict=True) if not count]
