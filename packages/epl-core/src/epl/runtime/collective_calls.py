"""Naming a collective call that some ranks skip: ``engine.save``, ``engine.load`` and ``engine.save_pretrained`` meet
first, through the job's key-value store.

Without this, a save that only rank 0 calls ends in the backend's words ("Connection closed by peer" once the other
rank ends its script), or pairs torch.distributed.checkpoint's collectives with whatever the other ranks do next.

Each rank counts its collective calls. At its n-th, it records in the job's store (torch.distributed's, never a
collective that could pair with training's) that it reached call n, and which call it is. Rank 0 waits until every
rank has, compares the calls, and publishes one verdict that every rank raises or goes on with:

- every rank made the same call (and rank 0 found no ``problem``): go on;
- the ranks made different calls at the same point: every rank raises, naming who called what;
- a rank did not call it within ``communication.timeout``, or ended its script instead: it is named as late
  ("engine.save is a collective call: every rank must call it; rank 1 did not call it within 600 s").

The bound is ``communication.timeout`` (the limit of every other collective of EPL): a rank may legitimately reach
a save later than the others (rank 0 evaluating before it), and a shorter bound would refuse such a job. A rank that
ends its script without the call is named sooner (within a second) where it says so: ranks ending cleanly on gloo
count themselves in the store (``epl/leaving/<restart>``, epl-comm's ``_leave_together``), which the waiting ranks
read; elsewhere it is named at the bound.

Cost when every rank calls: two store writes and a few reads per rank (about a millisecond; measured in
docs/checkpoints.md). ``problem`` is rank 0's refusal of the call (a folder it will not write): published with the
verdict, it is raised on every rank before any of them has done anything.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from typing import Any

from epl.errors import EplError

#: The n-th collective call of this process (the same n on every rank while they call the same).
_calls = itertools.count(1)
#: The store keys' prefix of this process's previous call, whose keys the next call deletes (None: none yet).
_previous: str | None = None
#: Seconds a rank other than 0 waits for rank 0's verdict beyond the bound (rank 0 decides at the bound).
_VERDICT_GRACE_S = 10.0
#: Seconds between two looks at which ranks are missing while waiting.
_DIAGNOSE_EVERY_S = 1.0
#: The longest pause between two polls of the store (the first are much shorter: most calls meet at once).
_MAX_POLL_S = 0.05


def agree_to_call(what: str, *, rank: int, world_size: int, timeout: float, problem: str | None = None) -> None:
    """Meet every rank at the collective call ``what`` (``"engine.save"``...), or raise on every rank.

    ``problem``: rank 0's reason to refuse the call (ignored on other ranks), raised on every rank. With one
    process, or without torch.distributed's store, only ``problem`` is raised.
    """
    store = _store() if world_size > 1 else None
    if store is None:
        if problem is not None and rank == 0:
            raise EplError(problem)
        return
    global _previous
    prefix, previous = f"epl/calls/{_restart()}/{next(_calls)}", _previous
    _previous = prefix
    try:
        store.set(f"{prefix}/{rank}", what)
        if previous is not None:  # read by rank 0 before the previous verdict, which this rank has seen
            _forget(store, f"{previous}/{rank}")
        if rank == 0:
            verdict = _decide(store, prefix, what, world_size, timeout, previous) or problem or ""
            store.set(f"{prefix}/verdict", verdict)
        else:
            verdict = _await_verdict(store, prefix, what, world_size, timeout)
    except (RuntimeError, OSError) as error:  # the store itself went away (its host, rank 0, ended)
        raise EplError(
            f"{what} is a collective call: every rank must call it; rank {rank} lost the job's store while waiting "
            f"for the others ({str(error).strip()[:120]}): rank 0, which holds it, has ended. Call {what} on every "
            "rank."
        ) from None
    if verdict:
        raise EplError(verdict)


def _decide(store: Any, prefix: str, what: str, world_size: int, timeout: float, previous: str | None) -> str | None:
    """Rank 0: wait until every rank reached the call (or is found late), then compare the calls. The verdict's
    error, or None when every rank made the same call. (The store keeps a call's keys until the next call.)"""
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    late: list[int] | None = []
    while late == []:  # every rank arrived between the poll and the look at who is missing: poll again
        late = _wait(store, keys, timeout, lambda missing: bool(missing), prefix, world_size)
    if late is not None:
        return _late(what, late, store, timeout)
    if previous is not None:  # every rank has read it: each is here
        _forget(store, f"{previous}/verdict")
    calls = [value.decode() for value in _get_all(store, keys)]
    if all(call == what for call in calls):
        return None
    who = ", ".join(f"rank {r}: {call}" for r, call in enumerate(calls))
    return (
        f"The ranks made different collective calls at the same point ({who}). engine.save, engine.load and "
        "engine.save_pretrained are collective calls: every rank must make them, in the same order."
    )


def _await_verdict(store: Any, prefix: str, what: str, world_size: int, timeout: float) -> str:
    """A rank other than 0: rank 0's verdict. When rank 0 itself never reaches the call, this rank names the late
    ranks (rank 0 names them otherwise, at the bound)."""
    limit = timeout + _VERDICT_GRACE_S
    late = _wait(store, [f"{prefix}/verdict"], limit, lambda missing: 0 in missing, prefix, world_size)
    if late is not None:
        if not late:
            return f"{what}: rank 0 reached the call but gave no verdict within {limit:.0f} s; it may be stuck."
        return _late(what, late, store, limit)
    verdict: bytes = store.get(f"{prefix}/verdict")
    return verdict.decode()


def _wait(
    store: Any, keys: list[str], timeout: float, speaks: Callable[[list[int]], bool], prefix: str, world_size: int
) -> list[int] | None:
    """Poll until ``keys`` all exist (None then). Else the ranks that have not reached the call: once ``timeout``
    seconds have passed, or as soon as a rank has ended its script while ``speaks(missing)`` (looked at every
    second)."""
    started = time.monotonic()
    pause, next_look = 0.0002, started + _DIAGNOSE_EVERY_S
    while not store.check(keys):
        now = time.monotonic()
        if now >= next_look:
            next_look = now + _DIAGNOSE_EVERY_S
            missing = _missing(store, prefix, world_size)
            if now - started >= timeout or (speaks(missing) and _leaving(store)):
                return missing
        time.sleep(pause)
        pause = min(pause * 2, _MAX_POLL_S)
    return None


def _missing(store: Any, prefix: str, world_size: int) -> list[int]:
    return [r for r in range(world_size) if not store.check([f"{prefix}/{r}"])]


def _late(what: str, missing: list[int], store: Any, waited: float) -> str:
    ended = _leaving(store)
    if ended >= len(missing):
        why = "did not call it: they ended their script instead"
    elif ended:
        why = f"did not call it ({ended} of them ended their script instead)"
    else:
        why = f"did not call it within {waited:.0f} s (communication.timeout)"
    return (
        f"{what} is a collective call: every rank must call it; {_ranks(missing)} {why}. Call {what} on every rank "
        "(not under `if rank == 0`); raise communication.timeout if a rank is only slow to get there."
    )


def _ranks(ranks: list[int]) -> str:
    """``rank 1`` or ``ranks 1, 3``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(rank) for rank in ranks)


def _leaving(store: Any) -> int:
    """How many ranks have started ending their process (epl-comm counts them in the store)."""
    try:
        return int(store.add(f"epl/leaving/{_restart()}", 0))
    except (RuntimeError, ValueError):
        return 0


def _get_all(store: Any, keys: list[str]) -> list[bytes]:
    """The values of ``keys``: one request where the store has ``multi_get``."""
    try:
        return list(store.multi_get(keys))
    except (AttributeError, RuntimeError):  # a store without it (older torch, some store kinds)
        return [store.get(key) for key in keys]


def _forget(store: Any, key: str) -> None:
    """Delete ``key`` (so a long job's calls do not pile up in the store), where the store can."""
    try:
        store.delete_key(key)
    except (AttributeError, RuntimeError):
        pass


def _restart() -> str:
    """The launcher's restart count (keys of an earlier attempt stay in torchrun's store)."""
    return os.environ.get("EPL_RESTART_COUNT", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _store() -> Any:
    """torch.distributed's default store, or None (no process group: nothing to meet through)."""
    try:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return None
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, ImportError):
        return None
