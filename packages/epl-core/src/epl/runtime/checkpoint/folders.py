"""The partial/commit/rename protocol of ``engine.save``, and what it may replace or delete: only a checkpoint of
its own and its own files, known by name.

``engine.save(path)`` writes ``<path>.partial``, moves a previous checkpoint at ``path`` to ``<path>.old``, renames
``<path>.partial`` to ``path`` and deletes ``<path>.old``. Each of these folders is deleted or replaced only when it
holds nothing but what ``engine.save`` writes:

- ``.metadata`` (and its ``.metadata.tmp`` while being written) and ``__<rank>_<n>.distcp``: torch.distributed
  checkpoint's files;
- ``.checksums-<rank>.json``: EPL's checksums, which only ``engine.save`` writes.

``path`` itself must be absent, an empty folder, or a checkpoint written by ``engine.save`` (those names only,
``.metadata`` and EPL's checksums among them: a checkpoint written by ``dcp.save`` by hand is not replaced).
Anything else in any of the three folders (a user's file, a subfolder, a link) is named by :func:`save_problem`
before anything is moved or deleted, and the deletions (:func:`remove_own`) skip whatever is not EPL's, so even a
file put there while a save runs is never deleted. :func:`replace` commits ``<path>.partial`` in ``path``'s place,
:func:`discard` deletes the previous checkpoint, and :func:`readable` finds the checkpoint to load (the previous one
when a save was cut off between its two renames).
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import re
import warnings
from collections.abc import Callable
from pathlib import Path

from epl.errors import EplError

_CHECKPOINT_FILE = re.compile(r"(__\d+)?\.metadata(\.tmp)?|__\d+_\d+\.distcp|\.checksums-\d+\.json")
#: How many foreign entries an error names.
_NAMED = 5


def is_checkpoint_file(name: str) -> bool:
    """Whether ``name`` is the name of a file ``engine.save`` writes into a checkpoint folder."""
    return _CHECKPOINT_FILE.fullmatch(name) is not None


def foreign_entries(folder: Path, owns: Callable[[str], bool]) -> list[str]:
    """The entries of ``folder`` that are not plain files ``owns`` claims (a subfolder, named with a trailing ``/``,
    or a link is never owned). An entry that disappears while looked at (another rank deleting) is skipped."""
    return sorted(name for name, owned in _entries(folder, owns) if not owned)


def remove_own(folder: Path, owns: Callable[[str], bool]) -> list[str]:
    """Delete the files of ``folder`` that ``owns`` claims, then ``folder`` if that emptied it. Returns what was left
    (never deleted); a missing folder or file is skipped (another rank may delete at the same time)."""
    if not folder.is_dir() or folder.is_symlink():
        return []
    left = []
    for name, owned in _entries(folder, owns):
        if not owned:
            left.append(name)
            continue
        with contextlib.suppress(FileNotFoundError):
            (folder / name).unlink()
    if not left:
        with contextlib.suppress(OSError):  # gone already, or something appeared meanwhile (kept)
            folder.rmdir()
    return sorted(left)


def _entries(folder: Path, owns: Callable[[str], bool]) -> list[tuple[str, bool]]:
    """Each entry of ``folder``: its name (a subfolder's with ``/``) and whether it is a plain file ``owns`` claims."""
    found = []
    try:
        listing = list(os.scandir(folder))
    except FileNotFoundError:
        return []
    for entry in listing:
        try:
            directory = entry.is_dir(follow_symlinks=False)
            plain = entry.is_file(follow_symlinks=False)
        except FileNotFoundError:
            continue
        found.append((entry.name + ("/" if directory else ""), plain and owns(entry.name)))
    return found


def save_problem(target: Path) -> str | None:
    """Why ``engine.save(target)`` must not write there (None: it may), found before anything is moved or deleted."""
    fix = "Nothing was moved or deleted. Save to a new or empty folder, or move those entries out."
    if target.exists() and not target.is_dir():
        return (
            f"engine.save({str(target)!r}): {target} exists and is not a folder; nothing was changed. Choose another "
            "path."
        )
    if target.is_dir():
        foreign = foreign_entries(target, is_checkpoint_file)
        if foreign:
            return (
                f"engine.save({str(target)!r}) will not write there: {target} holds {_few(foreign)}, which "
                f"engine.save did not write (it replaces only a previous checkpoint of its own). {fix}"
            )
        names = {entry.name for entry in target.iterdir()}
        if names and not (".metadata" in names and any(name.startswith(".checksums-") for name in names)):
            return (
                f"engine.save({str(target)!r}) will not write there: {target} holds {_few(sorted(names))} but is not a "
                "checkpoint written by engine.save (no .metadata and .checksums-<rank>.json: written by dcp.save by "
                f"hand, or an older EPL). {fix}"
            )
    for suffix, role in (
        (".partial", "the folder a save writes first"),
        (".old", "where a save moves the previous checkpoint"),
    ):
        scratch = target.with_name(target.name + suffix)
        if scratch.is_symlink() or (scratch.exists() and not scratch.is_dir()):
            return (
                f"engine.save({str(target)!r}) needs {scratch} ({role}), which exists and is not a folder of its own. "
                f"Nothing was changed. Move or rename {scratch}, or save to another path."
            )
        if scratch.is_dir():
            foreign = foreign_entries(scratch, is_checkpoint_file)
            if foreign:
                return (
                    f"engine.save({str(target)!r}) will not write there: {scratch} ({role}, deleted by a save) holds "
                    f"{_few(foreign)}, which engine.save did not write. Nothing was moved or deleted. Move or rename "
                    f"{scratch}, or save to another path."
                )
    return None


def _few(names: list[str]) -> str:
    shown = ", ".join(names[:_NAMED])
    return shown + (f" and {len(names) - _NAMED} more" if len(names) > _NAMED else "")


def replace(partial: Path, target: Path, *, keep_old: bool = False) -> None:
    """Put ``partial`` in ``target``'s place; the old checkpoint is removed only once the new one is there (or
    left at ``<target>.old`` with ``keep_old``, for :func:`discard`). Only EPL's own files are ever deleted
    (:func:`save_problem` checked the folders before the save began)."""
    old = target.with_name(target.name + ".old")
    if target.exists():
        if not target.is_dir():
            raise EplError(f"{target} exists and is not a checkpoint directory; choose another path.")
        left = remove_own(old, is_checkpoint_file)
        if left:
            raise EplError(f"{old} holds {left}, which engine.save did not write; move them out and save again.")
        os.replace(target, old)
    # else: a save cut off between its two renames left the previous checkpoint at <target>.old: kept until now
    os.replace(partial, target)
    if not keep_old:
        remove_own(old, is_checkpoint_file)


def discard(old: Path, rank: int) -> None:
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
        left = remove_own(old, is_checkpoint_file)
        if left:
            warnings.warn(f"{old} kept: it holds {left}, which engine.save did not write.", stacklevel=2)


def readable(target: Path) -> Path:
    """``target``, or the previous checkpoint when a save was cut off between its two renames."""
    if (target / ".metadata").exists():
        return target
    old = target.with_name(target.name + ".old")
    if (old / ".metadata").exists():
        return old
    raise EplError(f"No EPL checkpoint at {target}: write one with engine.save(path) first.")
