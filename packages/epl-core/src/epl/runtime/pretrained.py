"""transformers' checkpoint folders, read and written a slice per rank: ``Engine.load_pretrained/save_pretrained``.

**Loading** (:func:`load_pretrained`) reads ``model.safetensors``, or the shards that
``model.safetensors.index.json`` lists. Each rank reads only the tensors of its pipeline stage and, of a split
tensor, only its shard's rows or columns: safetensors' slices (``safe_open(...).get_slice``) map the file and
touch the bytes of the slice alone. Names are the model's own (the checkpoint's names, or the model's under a
prefix such as transformers' ``base_model_prefix``); missing or unexpected names are an error unless
``strict=False``; dtypes are converted to the model's. Pickle-based ``.bin`` checkpoints are refused: loading
them runs code from the file.

**Saving** (:func:`save_pretrained`) writes what transformers' ``save_pretrained`` writes: safetensors files
(``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json`` past
``max_shard_size``) under the original names, and ``config.json`` when the model has a ``config``. Nothing is
gathered: the ranks agree on every tensor's place in the files (a description of the pieces each holds, written
to the folder), rank 0 writes the headers, and each rank writes its own pieces into the byte ranges of the whole
tensors (a tensor several ranks hold is written by the first). A rank holds its share and one piece's bytes at
a time. Written into ``<path>.partial`` and renamed, as ``Engine.save`` does.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from epl.errors import EplError
from epl.runtime.checkpoint import _agree, _alone, _everyone, _remove, _replace

if TYPE_CHECKING:
    from epl.runtime.checkpoint import CheckpointedEngine

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
#: safetensors' names of the dtypes it stores.
DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip
#: Bytes per element of each safetensors dtype.
_ITEMSIZE: dict[str, int] = {code: dtype.itemsize for dtype, code in DTYPES.items()}
_PIECES = ".epl-pieces-{rank}.json"


# -- which part of a whole tensor a rank holds ----------------------------------------------------------------
@dataclass(frozen=True)
class Piece:
    """The part of a whole tensor one rank holds: along ``dim`` (of ``size`` items in the whole), the index
    ``ranges`` (start, stop), in order (several for a fused tensor's parts); ``dim`` -1: all of it."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    size: int = 0

    @staticmethod
    def of(tensor: torch.Tensor) -> Piece:
        """The piece ``tensor`` (a parameter or buffer of this rank's model) holds of its whole."""
        from epl.sharding.parameters import shard_spec

        spec = shard_spec(tensor)
        if spec is None:
            return Piece(-1, ())
        part = spec.size // spec.parts
        start, length = spec.group.slice(part).start, spec.group.sizes(part)[spec.group.index]
        ranges = tuple((j * part + start, j * part + start + length) for j in range(spec.parts))
        return Piece(spec.dim, ranges, spec.size)

    def whole_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        """The whole tensor's shape, from the shape of the piece."""
        if self.dim < 0:
            return local
        return (*local[: self.dim], self.size, *local[self.dim + 1 :])

    def elements(self, shape: tuple[int, ...]) -> int:
        """The elements of the piece of a whole tensor of ``shape``."""
        if self.dim < 0:
            return math.prod(shape)
        return sum(b - a for a, b in self.ranges) * math.prod(shape) // shape[self.dim]

    def read(self, view: Any) -> torch.Tensor:
        """The piece from a safetensors slice ``view`` (``safe_open(...).get_slice(name)``)."""
        if self.dim < 0:
            return view[:]
        parts = []
        for a, b in self.ranges:
            index = tuple([slice(None)] * self.dim + [slice(a, b)])
            parts.append(view[index])
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)


def _local_tensors(engine: CheckpointedEngine) -> Iterator[tuple[str, torch.Tensor, Piece]]:
    """Each (name, this rank's tensor, its piece of the whole) of the model's state."""
    for name, tensor in engine.model.state_dict(keep_vars=True).items():
        yield name, tensor, Piece.of(tensor)


# -- loading ---------------------------------------------------------------------------------------------------
def checkpoint_files(folder: Path) -> dict[str, Path]:
    """Each tensor name of the transformers checkpoint ``folder`` -> the safetensors file holding it."""
    if not folder.is_dir():
        raise EplError(f"{folder} is not a folder; load_pretrained takes a transformers checkpoint folder.")
    if (folder / INDEX).exists():
        index = json.loads((folder / INDEX).read_text())
        return {name: folder / file for name, file in index["weight_map"].items()}
    if (folder / SINGLE).exists():
        from safetensors import safe_open

        with safe_open(str(folder / SINGLE), framework="pt") as handle:
            return dict.fromkeys(handle.keys(), folder / SINGLE)
    pickled = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    if pickled:
        raise EplError(
            f"{folder} holds {pickled[0]}, a pickle-based checkpoint: loading it runs code from the file, so EPL "
            "does not read it. Convert it once where you trust it: transformers' "
            "Model.from_pretrained(folder).save_pretrained(out) writes safetensors (model.safetensors)."
        )
    raise EplError(f"{folder} holds neither {SINGLE} nor {INDEX}; is it a transformers checkpoint folder?")


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
    every rank calls it). Returns the bytes of the slices this rank read."""
    from safetensors import safe_open

    folder = Path(path)
    problem: str | None = None
    try:
        files = checkpoint_files(folder)
    except EplError as error:
        files, problem = {}, str(error)
    _agree(engine, problem)
    local = list(_local_tensors(engine))
    tied = _tied_names(engine)
    # Each name of this rank's and the names tied to it: a checkpoint holds one name of a tied tensor.
    candidates = {name: [name, *tied.get(name, ())] for name, *_ in local}
    names = name_map(list(dict.fromkeys(n for group in candidates.values() for n in group)), set(files))
    sources = {name: next((names[n] for n in group if names[n] in files), None) for name, group in candidates.items()}
    missing = [name for name, source in sources.items() if source is None]
    unexpected = _held_by_no_rank(engine, sorted(files), {names[n] for group in candidates.values() for n in group})
    if strict and (missing or unexpected):
        problem = (
            f"{folder} does not fit the model: missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}. Load the checkpoint of this "
            "model's class and config, or pass strict=False to load the tensors that match."
        )
    _agree(engine, problem)
    values: dict[str, torch.Tensor] = {}
    read = 0
    handles: dict[Path, Any] = {}
    try:
        for name, tensor, piece in local:
            source = sources[name]
            if source is None:
                continue
            file = files[source]
            handle = handles.get(file) or handles.setdefault(file, safe_open(str(file), framework="pt"))
            view = handle.get_slice(source)
            whole = tuple(view.get_shape())
            expected = piece.whole_shape(tuple(tensor.shape))
            if whole != expected:
                problem = f"{source!r} has shape {list(whole)} in {file.name}, the model's is {list(expected)}."
                break
            value = piece.read(view).to(tensor.dtype)
            read += value.numel() * _ITEMSIZE[view.get_dtype()]
            values[name] = value
    finally:
        handles.clear()
    _agree(engine, problem)
    current = engine.state_dict()["model"]
    current.update(values)
    engine.load_state_dict({"version": 1, "model": current, "optimizer": None, "global_step": engine.global_step})
    return read


def _tied_names(engine: CheckpointedEngine) -> dict[str, list[str]]:
    """Each name of this rank's model -> the other names of the same tensor (tied weights): one object under
    several names here, or a tie transformers declares (``get_expanded_tied_weights_keys``: the LM head's weight
    is the embedding's, on another pipeline stage), whose checkpoints hold one of the names only."""
    groups: dict[int, list[str]] = {}
    for name, tensor in engine.model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    tied = {name: [other for other in group if other != name] for group in groups.values() for name in group}
    declared = getattr(engine.model, "get_expanded_tied_weights_keys", None)
    if callable(declared):
        for target, source in declared(all_submodels=True).items():
            tied.setdefault(target, []).append(source)
            tied.setdefault(source, []).append(target)
    return tied


def _held_by_no_rank(engine: CheckpointedEngine, saved: list[str], mine: set[str]) -> list[str]:
    """The checkpoint's names (``saved``, the same list on every rank) that no rank's model holds (a pipeline
    rank holds its stage's names only): one all-reduce of a flag per name."""
    held = torch.tensor([name in mine for name in saved], dtype=torch.int64)
    if not _alone(engine) and held.numel():
        engine.context.communicator.all_reduce(held).wait()
    return [name for name, count in zip(saved, held.tolist(), strict=True) if not count]


# -- saving ----------------------------------------------------------------------------------------------------
def save_pretrained(
    engine: CheckpointedEngine, path: str | os.PathLike[str], *, max_shard_size: int | str = "5GB"
) -> None:
    """Write ``engine``'s model as a transformers checkpoint folder at ``path`` (a collective: every rank calls
    it); see the module's documentation."""
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    rank = engine.context.cluster.rank
    _everyone(engine, lambda: (_remove(partial), partial.mkdir(parents=True)))
    local = list(_local_tensors(engine))
    values = engine.state_dict()["model"]  # plain values (a technique that frees parameters hands copies)
    mine = [
        {"name": name, "dtype": DTYPES[t.dtype], "shape": list(piece.whole_shape(tuple(t.shape))),
         "dim": piece.dim, "ranges": [list(r) for r in piece.ranges]}
        for name, t, piece in local
    ]  # fmt: skip
    (partial / _PIECES.format(rank=rank)).write_text(json.dumps(mine))
    _everyone(engine, lambda: None)
    world = 1 if _alone(engine) else engine.context.cluster.world_size
    layout = _Layout([json.loads((partial / _PIECES.format(rank=r)).read_text()) for r in range(world)])
    layout.assign_files(_bytes(max_shard_size))
    _everyone(engine, lambda: layout.write_headers(partial))
    for name, _, piece in local:
        if layout.writer[(name, piece.dim, tuple(piece.ranges))] == rank:
            layout.write_piece(partial, name, piece, values[name])
    config = getattr(engine.model, "config", None)

    def finish() -> None:
        for r in range(world):
            (partial / _PIECES.format(rank=r)).unlink()
        layout.write_index(partial)
        if config is not None and hasattr(config, "to_json_file"):
            config.to_json_file(str(partial / "config.json"))

    _everyone(engine, finish)
    _everyone(engine, lambda: _replace(partial, target))


class _Layout:
    """Every tensor of the model, its place in the files, and which rank writes each of its pieces."""

    def __init__(self, ranks: list[list[dict[str, Any]]]) -> None:
        self.tensors: dict[str, dict[str, Any]] = {}
        self.writer: dict[tuple[str, int, tuple[tuple[int, ...], ...]], int] = {}
        covered: dict[str, int] = {}
        for rank, pieces in enumerate(ranks):
            for entry in pieces:
                name, shape = entry["name"], entry["shape"]
                known = self.tensors.setdefault(name, {"dtype": entry["dtype"], "shape": shape})
                if known["shape"] != shape or known["dtype"] != entry["dtype"]:
                    raise EplError(f"The ranks disagree on {name!r}: {known} and {entry}.")
                key = (name, entry["dim"], tuple(tuple(r) for r in entry["ranges"]))
                if key not in self.writer:
                    self.writer[key] = rank
                    covered[name] = covered.get(name, 0) + Piece(entry["dim"], key[2]).elements(tuple(shape))
        for name, info in self.tensors.items():
            if covered[name] != math.prod(info["shape"]):
                raise EplError(f"The ranks' pieces of {name!r} do not make the whole tensor; nothing was written.")
        #: Bytes of each whole tensor.
        self.sizes = {name: math.prod(t["shape"]) * _ITEMSIZE[t["dtype"]] for name, t in self.tensors.items()}
        self.files: list[list[str]] = []
        self.offsets: dict[str, tuple[int, int]] = {}  # name -> (file index, data offset in it)
        self.headers: list[bytes] = []

    def assign_files(self, limit: int) -> None:
        """Put the tensors in files of at most ``limit`` bytes (one larger tensor gets a file of its own)."""
        sizes = self.sizes
        current: list[str] = []
        total = 0
        for name in self.tensors:
            if current and total + sizes[name] > limit:
                self.files.append(current)
                current, total = [], 0
            current.append(name)
            total += sizes[name]
        if current or not self.files:
            self.files.append(current)
        for index, names in enumerate(self.files):
            offset = 0
            for name in names:
                self.offsets[name] = (index, offset)
                offset += sizes[name]
        self.headers = [self._header(index) for index in range(len(self.files))]

    def file_name(self, index: int) -> str:
        count = len(self.files)
        return SINGLE if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"

    def _header(self, index: int) -> bytes:
        """File ``index``'s safetensors header: its length, then the JSON of its tensors' places."""
        entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        for name in self.files[index]:
            info, start = self.tensors[name], self.offsets[name][1]
            entries[name] = {
                "dtype": info["dtype"],
                "shape": info["shape"],
                "data_offsets": [start, start + self.sizes[name]],
            }
        text = json.dumps(entries, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        return len(text).to_bytes(8, "little") + text

    def write_headers(self, folder: Path) -> None:
        """Create every file at its full size with its header (rank 0)."""
        for index, names in enumerate(self.files):
            header = self.headers[index]
            data = sum(self.sizes[n] for n in names)
            with open(folder / self.file_name(index), "wb") as handle:
                handle.write(header)
                handle.truncate(len(header) + data)

    def write_piece(self, folder: Path, name: str, piece: Piece, value: torch.Tensor) -> None:
        """Write this rank's ``value`` of ``name`` into its byte ranges of the whole tensor."""
        index, start = self.offsets[name]
        shape = tuple(self.tensors[name]["shape"])
        base = len(self.headers[index]) + start
        raw = value.detach().to("cpu").contiguous()
        item = raw.element_size()
        data = raw.view(torch.uint8) if raw.dim() else raw.reshape(1).view(torch.uint8)
        fd = os.open(folder / self.file_name(index), os.O_WRONLY)
        try:
            if piece.dim < 0:
                os.pwrite(fd, data.numpy().tobytes(), base)
                return
            outer = math.prod(shape[: piece.dim])
            inner = math.prod(shape[piece.dim + 1 :])
            local = 0
            for a, b in piece.ranges:
                part = raw.narrow(piece.dim, local, b - a).contiguous().reshape(outer, (b - a) * inner)
                local += b - a
                rows = part.view(torch.uint8) if part.numel() else part
                for o in range(outer):
                    offset = base + ((o * shape[piece.dim]) + a) * inner * item
                    os.pwrite(fd, rows[o].numpy().tobytes(), offset)
        finally:
            os.close(fd)

    def write_index(self, folder: Path) -> None:
        """``model.safetensors.index.json`` when the tensors fill several files (as transformers writes it)."""
        if len(self.files) == 1:
            return
        total = sum(self.sizes.values())
        weight_map = {name: self.file_name(self.offsets[name][0]) for name in self.tensors}
        (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def _bytes(size: int | str) -> int:
    """``max_shard_size`` in bytes: an integer, or a string such as ``"5GB"`` or ``"500MiB"`` (transformers')."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B\s*", size, re.IGNORECASE)
    if match is None:
        raise EplError(f"max_shard_size={size!r}: give bytes as an integer or a string such as '5GB' or '500MiB'.")
    number, unit, binary = float(match[1]), match[2].upper(), bool(match[3])
    power = " KMGT".index(unit or " ")
    return int(number * (1024 if binary else 1000) ** power)
