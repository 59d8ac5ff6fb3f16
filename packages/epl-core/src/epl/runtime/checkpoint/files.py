"""Reading checkpoint files without running what is in them, and checking that they are the files written.

torch.distributed.checkpoint (DCP) reads its ``.metadata`` file with ``pickle.load``, which
runs whatever code the file names, and reads ``BytesIO`` entries with
``torch.load(weights_only=False)``. EPL therefore stores its own entries as tensors (JSON
text in a ``uint8`` tensor: DCP reads tensors with ``weights_only=True``), and reads
``.metadata`` through :class:`SafeFileSystemReader`, whose unpickler builds only the
classes DCP's metadata is made of and refuses every other global.

Each rank records an XXH3 (64-bit) checksum and the size of every file it wrote
(``.checksums-<rank>.json``; rank 0's also covers ``.metadata``), computed as the bytes are
written (:func:`checksumming_writer`: reading the files back afterwards cost a sixth of a
save; hashing on the way costs 2.3 ms per 37 MB, 2% of a save). The ranks' checksums travel to
the coordinator with DCP's own write results, and the coordinator records them and commits the
checkpoint in DCP's ``finish`` step, so saving needs no collective of its own. Loading verifies
them before anything read is applied, so a truncated or corrupted file is refused. XXH3 (the
``xxhash`` package) rather than zlib's CRC-32 or SHA-256: measured on this machine it hashes
20 GB/s against CRC-32's 4 GB/s and SHA-256's 0.8 GB/s, and CRC-32 made verifying a third of
a small checkpoint's load. A cryptographic hash would not stop
tampering anyway, since whoever can change a file can change its checksum: safety against
tampering comes from never running code and from the strict checks of shapes, dtypes and names.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import mmap
import os
import pickle
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch
import xxhash

from epl.errors import EplError

_CHECKSUMS = ".checksums-{rank}.json"


# -- EPL's own entries: JSON in a uint8 tensor -------------------------------------------------------------------
def encode_json(value: Any) -> torch.Tensor:
    """``value`` (numbers, strings, None, lists, tuples, dicts, tensors) as a uint8 tensor of JSON text."""
    text = json.dumps(_to_plain(value), allow_nan=True)
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8).clone()


def decode_json(data: torch.Tensor) -> Any:
    """Inverse of :func:`encode_json`."""
    return _from_plain(json.loads(bytes(data.tolist()).decode()))


def _to_plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return {"__tensor__": value.tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, tuple):
        return {"__tuple__": [_to_plain(item) for item in value]}
    if isinstance(value, list):
        return [_to_plain(item) for item in value]
    if isinstance(value, dict):
        if not all(isinstance(key, str) for key in value):
            raise EplError(f"Checkpoint metadata keys must be strings, got {sorted(map(repr, value))[:3]}.")
        return {key: _to_plain(item) for key, item in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise EplError(
        f"Cannot store {type(value).__name__} {value!r} in a checkpoint's metadata: only numbers, strings, None, "
        "lists, tuples, dicts and tensors are stored (as data, never pickled)."
    )


def _from_plain(value: Any) -> Any:
    if isinstance(value, list):
        return [_from_plain(item) for item in value]
    if isinstance(value, dict):
        if "__tensor__" in value:
            return torch.tensor(value["__tensor__"], dtype=getattr(torch, value["dtype"]))
        if "__tuple__" in value:
            return tuple(_from_plain(item) for item in value["__tuple__"])
        return {key: _from_plain(item) for key, item in value.items()}
    return value


# -- DCP's metadata without pickle's code execution ------------------------------------------------------------
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only the classes of DCP's metadata (and torch dtypes); any other global is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def read_metadata(path: Path) -> Any:
    """DCP's ``Metadata`` from the file ``path``, built without running code from it."""
    try:
        with path.open("rb") as file:
            return _MetadataUnpickler(file).load()
    except OSError as error:
        raise unreadable_file_error(path, error) from None
    except Exception as error:  # noqa: BLE001 - a damaged pickle fails in many ways (EOFError, KeyError...)
        raise EplError(
            f"The checkpoint metadata {path} is not what torch.distributed.checkpoint writes ({error}); it was "
            "refused without running anything from it. Load only checkpoints written by engine.save."
        ) from None


def safe_reader(folder: Path) -> Any:
    """A ``torch.distributed.checkpoint.FileSystemReader`` for ``folder`` whose metadata is read by
    :func:`read_metadata` (DCP reads tensors with ``weights_only=True`` itself), and which keeps the tensors it
    reads in ``loaded`` (by key) instead of copying them into the tensors given to ``dcp.load`` (which are only
    placeholders of the right shape and dtype).

    Why its own ``read_data``: DCP's copies each tensor ``torch.load`` made into the tensor the load was given,
    so loading into new tensors (what EPL does: nothing read is applied before every file is verified) wrote
    every byte into fresh memory twice. Measured: copying 75 MB into fresh memory takes 31 ms, into memory in
    use 12 ms, and DCP by hand loads into the model's own tensors; the extra copy was the largest part of EPL's
    load taking 1.45x ``dcp.load`` by hand on the checkpoint benchmark (about 19 of the 28 ms more). Here each
    tensor is read once, as DCP reads it (``torch.load`` of the item's slice of the file, ``weights_only=True``),
    then checked against the shape and dtype the metadata gives it. Only tensors are read: a checkpoint entry of
    bytes (which DCP unpickles with ``weights_only=False``) is refused.

    A placeholder that one stored rectangle covers keeps what was read (a copy when it is a small part of the stored
    rectangle, so the rest is freed); one that several stored rectangles cover (saved under another layout) is
    assembled in a tensor of its own. Placeholders of :class:`epl.runtime.checkpoint.chunks.Rectangles` give
    ``Rectangles`` of what was read. A placeholder the checkpoint does not cover whole is refused.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.futures import Future

    from epl.torch_private import narrow_by_index

    class SafeFileSystemReader(FileSystemReader):
        """DCP's file reader, its metadata read without pickle's code execution (once per reader), its tensors
        kept as read."""

        cached: Any = None

        def __init__(self) -> None:
            super().__init__(str(folder))
            #: Every tensor read, by the key it was asked for.
            self.loaded: dict[str, torch.Tensor] = {}

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if self.cached is None:
                self.cached = read_metadata(folder / ".metadata")
                if getattr(self.cached, "storage_meta", None) is None:
                    self.cached.storage_meta = StorageMeta()
            self.cached.storage_meta.load_id = self.load_id
            return self.cached

        def read_data(self, plan: Any, planner: Any) -> Any:
            by_file: dict[str, list[Any]] = {}
            for item in plan.items:
                by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
            received = _Received()
            for relative_path, items in by_file.items():
                path = folder / relative_path
                try:
                    with path.open("rb") as stream:
                        for item in sorted(items, key=lambda item: self.storage_data[item.storage_index].offset):
                            received.add(item, self._read_tensor(stream, item, planner), planner)
                except EplError:
                    raise
                except Exception as error:  # noqa: BLE001 - named: torch.load's errors do not say which file
                    raise unreadable_file_error(path, error) from error
            self.loaded.update(received.results(planner.state_dict, folder))
            done: Future[None] = Future()
            done.set_result(None)
            return done

        def _read_tensor(self, stream: Any, item: Any, planner: Any) -> torch.Tensor:
            info = self.storage_data[item.storage_index]
            if item.type == LoadItemType.BYTE_IO or info.transform_descriptors:
                raise EplError(f"{item.dest_index.fqn} is not a plain tensor: the checkpoint was not written by EPL.")
            tensor = torch.load(self._slice_file(stream, info), map_location="cpu", weights_only=True)
            tensor = narrow_by_index(tensor, item.storage_offsets, item.lengths)
            wanted = planner.resolve_tensor(item)
            if tensor.shape != wanted.shape or tensor.dtype != wanted.dtype:
                raise EplError(
                    f"{item.dest_index.fqn} in {info.relative_path} is a {tensor.dtype} tensor of shape "
                    f"{list(tensor.shape)}, its metadata says {wanted.dtype} {list(wanted.shape)}."
                )
            return tensor

    return SafeFileSystemReader()


class _Received:
    """What a rank read for each placeholder rectangle (by key and offsets), and how many of its elements."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        self.counts: dict[tuple[str, tuple[int, ...]], int] = {}

    def add(self, item: Any, tensor: torch.Tensor, planner: Any) -> None:
        """Keep ``tensor``, read for the read item ``item`` (a part of one placeholder rectangle, or all of it)."""
        from torch.distributed.checkpoint.utils import find_state_dict_object

        from epl.torch_private import narrow_by_index

        index = item.dest_index
        key = (index.fqn, tuple(index.offset) if index.offset is not None else ())
        target = find_state_dict_object(planner.state_dict, index)
        self.counts[key] = self.counts.get(key, 0) + math.prod(item.lengths)
        if tuple(item.lengths) == tuple(target.shape):  # all of it, from one stored rectangle
            whole_storage = tensor.untyped_storage().nbytes() <= tensor.numel() * tensor.element_size()
            self.values[key] = tensor if whole_storage else tensor.clone()
            return
        if key not in self.values:
            self.values[key] = torch.empty(tuple(target.shape), dtype=tensor.dtype)
        narrow_by_index(self.values[key], item.dest_offsets, item.lengths).copy_(tensor)

    def results(self, placeholders: dict[str, Any], folder: Path) -> dict[str, torch.Tensor]:
        """What was read for each of ``placeholders`` (by key); a placeholder read in part is refused."""
        from epl.runtime.checkpoint.chunks import Rectangles

        results: dict[str, torch.Tensor] = {}
        for fqn, placeholder in placeholders.items():
            if isinstance(placeholder, Rectangles):
                parts = [self._value(fqn, offsets, value, folder) for offsets, value in placeholder.blocks]
                results[fqn] = placeholder.holding(parts)
            elif isinstance(placeholder, torch.Tensor):
                results[fqn] = self._value(fqn, (0,) * placeholder.dim(), placeholder, folder)
        return results

    def _value(self, fqn: str, offsets: tuple[int, ...], placeholder: torch.Tensor, folder: Path) -> torch.Tensor:
        if not placeholder.numel():
            return torch.empty(placeholder.shape, dtype=placeholder.dtype)
        count = self.counts.get((fqn, offsets), 0)
        if count != placeholder.numel():
            raise EplError(
                f"The checkpoint {folder} holds {count} of the {placeholder.numel()} elements of {fqn} at "
                f"{list(offsets)} that this rank reads: it was not written whole. Load an intact checkpoint."
            )
        return self.values[(fqn, offsets)]


# -- checksums -----------------------------------------------------------------------------------------------------
def _digest(hasher: Any, size: int) -> str:
    return f"xxh3_64:{hasher.hexdigest()}:{size}"


class _ChecksummingStream(io.IOBase):
    """A file opened for writing that keeps the checksum and size of what is written through it (DCP and
    ``torch.save`` write sequentially; a seek marks the running checksum unusable), and the first error of writing
    it (``torch.save`` loses it: a full disk reached it as "unexpected pos 704 vs 598")."""

    def __init__(self, raw: Any, path: str | os.PathLike[str] = "") -> None:
        self.raw: BinaryIO = raw  # the file DCP's FileSystem opened (binary, for writing)
        self.hasher, self.size, self.sequential = xxhash.xxh3_64(), 0, True
        self.path = str(path)
        #: The first OSError of a write, with the file's path (None: none).
        self.error: OSError | None = None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.hasher.update(view)
        self.size += view.nbytes
        try:
            return self.raw.write(view)
        except OSError as error:
            if self.error is None:
                self.error = OSError(error.errno, error.strerror or str(error), self.path)
            raise

    def tell(self) -> int:
        return self.raw.tell()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self.sequential = False
        return self.raw.seek(offset, whence)

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def checksum(self) -> str | None:
        return _digest(self.hasher, self.size) if self.sequential else None


#: The fqn of the write result that carries a rank's checksums to the coordinator (never written to ``.metadata``).
_SUMS_ENTRY = "\0epl/checksums"


def checksumming_writer(folder: Path, commit: Callable[[], None] | None = None) -> Any:
    """A ``torch.distributed.checkpoint.FileSystemWriter`` for ``folder`` that checksums every file as it writes it.

    Each rank's checksums travel to the coordinator with its write results (an extra entry that never reaches
    ``.metadata``); there DCP's ``finish`` writes ``.metadata``, then the writer records every rank's checksums
    (``.checksums-<rank>.json``) and calls ``commit``. DCP runs ``finish`` once every rank's files are written
    and returns on no rank before it is done, so ``commit`` is where a complete checkpoint can be made visible.
    """
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    sums: dict[str, str | None] = {}
    lock = threading.Lock()

    class ChecksummingFileSystem(FileSystem):
        """DCP's local file system, its written files checksummed on the way."""

        @contextlib.contextmanager
        def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
            if mode != "wb":
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            try:
                with super().create_stream(path, mode) as raw:
                    stream = _ChecksummingStream(raw, path)
                    try:
                        yield stream
                    except Exception:
                        if stream.error is not None:  # what torch.save reported instead (a full disk, a failed disk)
                            raise stream.error from None
                        raise
            except OSError as error:  # closing flushes the rest: name the file there too
                if error.filename is None and error.errno is not None:
                    raise OSError(error.errno, error.strerror, str(path)) from None
                raise
            with lock:
                sums[Path(path).name] = stream.checksum()

    class ChecksummingFileSystemWriter(FileSystemWriter):
        """DCP's file writer that records what it wrote, and commits on the coordinator."""

        written_checksums = sums

        def __init__(self) -> None:
            super().__init__(str(folder))
            self.fs = ChecksummingFileSystem()

        def prepare_local_plan(self, plan: Any) -> Any:
            # DCP's own also warns when the folder holds a .metadata: EPL removes a cut-off save's folder itself.
            self.fs.mkdir(self.path)
            return plan

        def write_data(self, plan: Any, planner: Any) -> Any:
            def with_checksums(done: Any) -> list[Any]:
                with lock:
                    mine = dict(sums)
                return [*done.value(), WriteResult(MetadataIndex(_SUMS_ENTRY), 0, mine)]

            return super().write_data(plan, planner).then(with_checksums)

        def finish(self, metadata: Any, results: list[list[Any]]) -> None:
            by_rank: dict[int, dict[str, str | None]] = {}
            plain = []
            for rank, written in enumerate(results):
                by_rank[rank] = next((r.storage_data for r in written if r.index.fqn == _SUMS_ENTRY), {})
                plain.append([r for r in written if r.index.fqn != _SUMS_ENTRY])
            super().finish(metadata, plain)
            with lock:  # .metadata is written as .metadata.tmp, then renamed
                by_rank.setdefault(0, {})[".metadata"] = sums.get(".metadata.tmp")
            for rank, entries in by_rank.items():
                write_checksums(folder, rank, entries, entries)
            if commit is not None:
                commit()

    return ChecksummingFileSystemWriter()


def checksum(path: Path) -> str:
    """The checksum of the file ``path`` and its size, as text (read through a memory map: no copy of the
    file)."""
    hasher = xxhash.xxh3_64()
    with path.open("rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size:
            with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                hasher.update(mapped)
    return _digest(hasher, size)


def write_checksums(
    folder: Path, rank: int, names: Iterable[str], known: Mapping[str, str | None] | None = None
) -> None:
    """Record the checksums of the files ``names`` of ``folder`` that ``rank`` wrote (taken from ``known`` where
    it has them, else read from the files)."""
    known = known or {}
    sums = {name: known.get(name) or checksum(folder / name) for name in sorted(names)}
    (folder / _CHECKSUMS.format(rank=rank)).write_text(json.dumps(sums, indent=1) + "\n")


def recorded_checksums(folder: Path) -> dict[str, str]:
    """Every file's recorded checksum (the union of every rank's record)."""
    records = sorted(folder.glob(".checksums-*.json"))
    if not records:
        raise EplError(
            f"The checkpoint {folder} has no checksums (.checksums-<rank>.json), so its files cannot be checked: "
            "it was not written by this version of engine.save. Save it again with this version."
        )
    sums: dict[str, str] = {}
    for record in records:
        try:
            entries = json.loads(record.read_text())
        except (OSError, ValueError) as error:
            raise EplError(f"Cannot read the checksums {record}: {error}.") from None
        if not isinstance(entries, dict) or not all(isinstance(v, str) for v in entries.values()):
            raise EplError(f"The checksums {record} are not a map of file names to checksums.")
        sums.update(entries)
    unlisted = [path.name for path in folder.glob("*.distcp") if path.name not in sums]
    if unlisted or ".metadata" not in sums:
        raise EplError(f"The checkpoint {folder} has files without a recorded checksum: {unlisted or ['.metadata']}.")
    return sums


def first_damaged(folder: Path, names: Iterable[str], sums: dict[str, str]) -> str | None:
    """The first of ``names`` whose content does not match its recorded checksum (or is missing), else None."""
    for name in names:
        path = folder / name
        if not path.is_file() or checksum(path) != sums[name]:
            return name
    return None


def damaged_file_error(folder: Path, name: str, sums: dict[str, str]) -> EplError:
    """The error for a file of ``folder`` that is not the file written."""
    path = folder / name
    try:
        found = checksum(path) if path.is_file() else "no such file"
    except OSError as error:
        found = f"an unreadable file ({error})"
    return EplError(
        f"The checkpoint file {path} is damaged: recorded {sums[name]}, found {found} (a truncated copy, a flipped "
        "bit or another file). Nothing was loaded; load an intact copy of the checkpoint."
    )


def unreadable_file_error(path: Path, error: BaseException) -> EplError:
    """The error for the checkpoint file ``path`` that reading raised ``error`` on (named: the readers' errors do
    not say which file)."""
    lines = str(error).strip().splitlines()
    reason = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return EplError(
        f"Cannot read the checkpoint file {path} ({reason}): it is missing, truncated or not the file written. "
        "Nothing was loaded; load an intact copy of the checkpoint."
    )
