"""Writing an engine's model as a transformers checkpoint folder, each rank its own pieces, nothing gathered."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from epl.errors import EplError
from epl.pretrained.pieces import _ITEMSIZE, DTYPES, INDEX, SINGLE, Piece, local_tensors
from epl.runtime.checkpoint import _alone, _everyone, _remove, _replace

if TYPE_CHECKING:
    from epl.runtime.checkpoint import CheckpointedEngine

_PIECES = ".epl-pieces-{rank}.json"


def save_pretrained(
    engine: CheckpointedEngine, path: str | os.PathLike[str], *, max_shard_size: int | str = "5GB"
) -> None:
    """Write ``engine``'s model as a transformers checkpoint folder at ``path`` (a collective: every rank calls
    it); see the module's documentation."""
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    rank = engine.context.cluster.rank
    _everyone(engine, lambda: (_remove(partial), partial.mkdir(parents=True)))
    local = list(local_tensors(engine))
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
