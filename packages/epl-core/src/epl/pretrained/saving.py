"""Writing an engine's model as a transformers checkpoint folder, each rank its own pieces, nothing gathered.

**Beside what is there**, as transformers' ``save_pretrained`` writes: the folder may hold a tokenizer, a README,
subfolders, anything; ``save_pretrained`` replaces only the files it writes and deletes only weight files of an
earlier export that this one does not rewrite. The files it owns:

- the weights: ``model.safetensors``, ``model-<k>-of-<n>.safetensors`` (5 digits each) and
  ``model.safetensors.index.json``. Those of an earlier export that this one does not write are deleted (an old
  single file beside new shards, shards of another count, an old index beside a single file), so no loader reads a
  stale one (transformers deletes old shards of its own name pattern; it leaves an old ``model.safetensors``, which
  loaders prefer to the new shards' index);
- ``config.json`` when the model has a ``config``, and ``generation_config.json`` when it can generate (as
  transformers writes them): replaced when written, never deleted.
- for a PEFT model's adapters (:mod:`~epl.pretrained.export`): ``adapter_model.safetensors`` and
  ``adapter_config.json`` only; the model's files beside them are kept.

Everything else is kept. A path that is a file, one of those names held by a folder, or a ``<path>.partial`` holding
anything else is refused on every rank before anything is written (``<path>.partial`` is EPL's scratch folder).

**Safely**: every file is written into ``<path>.partial`` first. When every rank has written its pieces, rank 0
moves them into ``path`` (a rename of the folder when ``path`` does not exist). Over an earlier export the renames
go one file at a time, in an order that never lets an index refer to a mix of old and new shards: the old index
first, the new weight files, the stale weight files deleted, then the new index and the configs. A crash during
these renames (milliseconds) leaves a folder that loaders refuse (no index, or missing shards), never a silent mix;
a crash while writing (the long part) leaves the earlier export as it was. A failure on any rank (a full disk) is
raised on every rank, naming the rank and the file, and the partial files are deleted.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from epl.errors import EplError
from epl.pretrained.export import (
    ADAPTER_CONFIG,
    ADAPTER_SINGLE,
    CONFIG,
    GENERATION_CONFIG,
    Export,
    describe_export,
)
from epl.pretrained.pieces import _ITEMSIZE, DTYPES, INDEX, SINGLE, Piece, is_model_weights_file
from epl.runtime import agreement
from epl.runtime.checkpoint import meeting
from epl.runtime.checkpoint.folders import foreign_entries, remove_own

if TYPE_CHECKING:
    from epl.runtime.checkpoint.common import CheckpointedEngine

_PIECES = ".epl-pieces-{rank}.json"
_SCRATCH = re.compile(r"\.epl-pieces-\d+\.json")


def is_weights_file(name: str) -> bool:
    """Whether ``name`` is a weight file (or the index) ``save_pretrained`` writes, and so replaces or deletes."""
    return name == ADAPTER_SINGLE or is_model_weights_file(name)


def _is_output(name: str) -> bool:
    return is_weights_file(name) or name in (CONFIG, GENERATION_CONFIG, ADAPTER_CONFIG)


def _is_scratch(name: str) -> bool:
    return _is_output(name) or _SCRATCH.fullmatch(name) is not None


def save_pretrained(
    engine: CheckpointedEngine,
    path: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    merged: bool = False,
) -> None:
    """Write ``engine``'s model as a transformers checkpoint folder at ``path`` (a collective: every rank calls
    it), beside the files already there; see the module's documentation. A PEFT model is written as its adapters
    (PEFT's ``adapter_model.safetensors`` and ``adapter_config.json``), or with ``merged=True`` as the base model
    with the adapters merged into its weights (transformers' format, the base's names and config)."""
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    limit = _bytes(max_shard_size)
    meeting.meet(engine, "engine.save_pretrained", lambda: _target_problem(target, partial))
    export: Export | None = None
    problem: str | None = None
    try:
        export = describe_export(engine, merged=merged)
    except EplError as error:
        problem = f"engine.save_pretrained({str(target)!r}): {error} Nothing was written."
    communicator = None if meeting.alone(engine) else engine.context.communicator
    agreement.agree(communicator, problem, refused="could not describe its export")
    assert export is not None
    try:
        _write(engine, target, partial, limit, export)
    except EplError:
        if meeting.alone(engine) or engine.context.cluster.rank == 0:  # every rank has stopped writing (agreed)
            remove_own(partial, _is_scratch)
        raise


def _write(engine: CheckpointedEngine, target: Path, partial: Path, limit: int, export: Export) -> None:
    """The phases of a save, each agreed by every rank before the next (a failure is raised on every rank)."""
    alone = meeting.alone(engine)
    rank = 0 if alone else engine.context.cluster.rank
    world = 1 if alone else engine.context.cluster.world_size
    local = export.tensors
    laid: list[_Layout] = []

    def describe_pieces() -> None:
        mine = [
            {"name": name, "dtype": DTYPES[dtype], "shape": list(piece.shape),
             "blocks": [[list(b.offsets), list(b.sizes)] for b in piece.blocks]}
            for name, dtype, piece, _ in local
        ]  # fmt: skip
        (partial / _PIECES.format(rank=rank)).write_text(json.dumps(mine))

    def lay_out() -> None:
        layout = _Layout([json.loads((partial / _PIECES.format(rank=r)).read_text()) for r in range(world)])
        layout.single = export.single
        layout.assign_files(limit if export.shards else None)
        laid.append(layout)
        if rank == 0:
            layout.write_headers(partial)

    def write_pieces() -> None:
        values = engine.state_dict()["model"]  # plain values (a technique that frees parameters hands copies)
        layout = laid[0]
        for name, _, piece, value in local:
            if piece.blocks and layout.writer[_key(name, [(b.offsets, b.sizes) for b in piece.blocks])] == rank:
                layout.write_piece(partial, name, piece, value(values))

    def finish() -> None:
        for r in range(world):
            (partial / _PIECES.format(rank=r)).unlink()
        laid[0].write_index(partial)
        export.write_configs(partial)

    _phase(engine, target, lambda: _scratch_folder(partial), only_rank_0=True)
    _phase(engine, target, describe_pieces)
    _phase(engine, target, lay_out)
    _phase(engine, target, write_pieces)
    _phase(engine, target, finish, only_rank_0=True)
    _phase(engine, target, lambda: _commit(partial, target, export.owns), only_rank_0=True)


def _phase(engine: CheckpointedEngine, target: Path, action: Callable[[], None], *, only_rank_0: bool = False) -> None:
    """Run ``action`` (on rank 0 only, or on every rank), then agree with every rank: an error on any rank is
    raised on every rank, naming it (:func:`epl.runtime.agreement.agree`, one all-reduce when none failed)."""
    alone, rank = meeting.alone(engine), engine.context.cluster.rank
    problem = None
    if not only_rank_0 or rank == 0 or alone:
        try:
            action()
        except Exception as error:  # noqa: BLE001 - every rank raises it, named (a rank alone would hang the rest)
            problem = _failure(target, rank, error)
    communicator = None if alone else engine.context.communicator
    agreement.agree(communicator, problem, refused=f"could not write its part of {target}")


def _failure(target: Path, rank: int, error: Exception) -> str:
    if isinstance(error, EplError):
        return str(error)
    text = str(error).strip().splitlines()
    first = text[0] if text else type(error).__name__
    hint = ""
    if isinstance(error, OSError) and "No space left on device" in first:
        hint = (
            f" Nothing was changed at {target} and the partial files were deleted: free space, or save to another "
            "file system."
        )
    return f"engine.save_pretrained could not write {target} on rank {rank}: {first}.{hint}"


def _target_problem(target: Path, partial: Path) -> str | None:
    """Why ``save_pretrained`` must not write at ``target`` (None: it may), found before anything is written."""
    call = f"engine.save_pretrained({str(target)!r})"
    if target.exists() and not target.is_dir():
        return f"{call}: {target} exists and is not a folder; nothing was changed. Choose another path."
    if target.is_dir():
        blocking = sorted(
            entry.name
            for entry in target.iterdir()
            if _is_output(entry.name) and (entry.is_dir() or not entry.exists())
        )
        if blocking:
            return (
                f"{call}: {target} holds {blocking}, which are not files, where it writes files of those names; "
                "nothing was changed. Move them out, or choose another path."
            )
    if partial.is_symlink() or (partial.exists() and not partial.is_dir()):
        return f"{call} writes into {partial} first, which exists and is not a folder; nothing was changed. Move it."
    if partial.is_dir():
        foreign = foreign_entries(partial, _is_scratch)
        if foreign:
            return (
                f"{call} writes into {partial} first (and deletes it), which holds {foreign[:5]}: files "
                "save_pretrained did not write. Nothing was changed. Move or rename that folder."
            )
    return None


def _scratch_folder(partial: Path) -> None:
    """An empty ``<path>.partial`` (what a cut-off save left there is deleted: only its own files)."""
    left = remove_own(partial, _is_scratch)
    if left:
        raise EplError(f"{partial} holds {left}, which save_pretrained did not write; move them out and save again.")
    partial.mkdir(parents=True)


def _commit(partial: Path, target: Path, owns: Callable[[str], bool]) -> None:
    """Move the files of ``partial`` into ``target`` (see the module's documentation for the order) and delete the
    weight files of an earlier export of the same kind (``owns``) that this one did not write."""
    if not target.exists():
        os.replace(partial, target)
        return
    written = sorted(entry.name for entry in partial.iterdir())
    earlier = sorted(
        entry.name for entry in target.iterdir() if owns(entry.name) and entry.is_file() and entry.name != INDEX
    )
    if owns(INDEX) and (target / INDEX).is_file():  # first: from here on no index refers to a mix of old and new shards
        (target / INDEX).unlink()
    for name in written:
        if is_weights_file(name) and name != INDEX:
            os.replace(partial / name, target / name)
    for name in earlier:
        if name not in written:
            (target / name).unlink()
    for name in (INDEX, CONFIG, GENERATION_CONFIG, ADAPTER_CONFIG):
        if name in written:
            os.replace(partial / name, target / name)
    partial.rmdir()


class _Layout:
    """Every tensor of the model, its place in the files, and which rank writes each of its pieces."""

    def __init__(self, ranks: list[list[dict[str, Any]]]) -> None:
        self.tensors: dict[str, dict[str, Any]] = {}
        #: Which rank writes each set of rectangles (the first rank holding it: a replica's copy is written once).
        self.writer: dict[Any, int] = {}
        covered: dict[str, int] = {}
        for rank, pieces in enumerate(ranks):
            for entry in pieces:
                name, shape = entry["name"], entry["shape"]
                known = self.tensors.setdefault(name, {"dtype": entry["dtype"], "shape": shape})
                if known["shape"] != shape or known["dtype"] != entry["dtype"]:
                    raise EplError(f"The ranks disagree on {name!r}: {known} and {entry}.")
                key = _key(name, entry["blocks"])
                if key not in self.writer:
                    self.writer[key] = rank
                    covered[name] = covered.get(name, 0) + sum(math.prod(sizes) for _, sizes in entry["blocks"])
        for name, info in self.tensors.items():
            if covered[name] != math.prod(info["shape"]):
                raise EplError(f"The ranks' pieces of {name!r} do not make the whole tensor; nothing was written.")
        #: Bytes of each whole tensor.
        self.sizes = {name: math.prod(t["shape"]) * _ITEMSIZE[t["dtype"]] for name, t in self.tensors.items()}
        self.files: list[list[str]] = []
        self.offsets: dict[str, tuple[int, int]] = {}  # name -> (file index, data offset in it)
        self.headers: list[bytes] = []
        #: The name of the file when the tensors fill one.
        self.single = SINGLE

    def assign_files(self, limit: int | None) -> None:
        """Put the tensors in files of at most ``limit`` bytes (one larger tensor gets a file of its own; None: all
        in one file)."""
        sizes = self.sizes
        current: list[str] = []
        total = 0
        for name in self.tensors:
            if current and limit is not None and total + sizes[name] > limit:
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
        return self.single if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"

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
        """Write this rank's ``value`` (its local tensor) of ``name`` into the byte ranges of its rectangles of the
        whole tensor: one write per run of contiguous bytes."""
        index, start = self.offsets[name]
        shape = tuple(self.tensors[name]["shape"])
        base = len(self.headers[index]) + start
        raw = value.detach().to("cpu")
        item = raw.element_size()
        path = folder / self.file_name(index)
        fd = os.open(path, os.O_WRONLY)
        try:
            for block in piece.blocks:
                part = block.in_local(raw).contiguous()
                # Dims after the last one the rectangle cuts are whole: each run is the rectangle's extent there.
                cut = max((d for d in range(len(shape)) if block.sizes[d] != shape[d]), default=-1)
                inner = math.prod(shape[cut + 1 :])
                runs = part.reshape(-1, (block.sizes[cut] if cut >= 0 else 1) * inner).view(torch.uint8)
                outer = itertools.product(
                    *(range(block.offsets[d], block.offsets[d] + block.sizes[d]) for d in range(cut))
                )
                for run, at in zip(runs, outer, strict=True):
                    element = sum(i * math.prod(shape[d + 1 :]) for d, i in enumerate(at))
                    element += block.offsets[cut] * inner if cut >= 0 else 0
                    _pwrite_all(fd, run.numpy().tobytes(), base + element * item)
        except OSError as error:  # name the file (a full disk)
            raise OSError(error.errno, error.strerror, str(path)) from None
        finally:
            os.close(fd)

    def write_index(self, folder: Path) -> None:
        """``model.safetensors.index.json`` when the tensors fill several files (as transformers writes it)."""
        if len(self.files) == 1:
            return
        total = sum(self.sizes.values())
        weight_map = {name: self.file_name(self.offsets[name][0]) for name in self.tensors}
        (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def _key(name: str, blocks: Any) -> tuple[str, tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]]:
    """A tensor's name and a rank's rectangles of it (offsets, sizes), as a key: ranks with the same key hold the same
    values (replicas)."""
    return name, tuple((tuple(offsets), tuple(sizes)) for offsets, sizes in blocks)


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (``pwrite`` may write part of it on a full disk, and raises on the rest)."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        if written == 0:
            raise OSError(28, os.strerror(28))
        view, offset = view[written:], offset + written


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
