"""Numbered records of every collective, and the report of which ranks did not arrive.

Each communicator numbers its collectives (1, 2, 3, ...) on every rank. A
heartbeat thread publishes the number of the last collective this rank started
to the job's key-value store; when a wait times out, the waiting rank reads every
member's published number and names those that did not reach the collective.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from epl.plugin_api import EplError, Work

#: Seconds between two publications of this rank's progress.
HEARTBEAT_SECONDS = 0.2
#: Records kept per communicator (for the report of what this rank did last).
KEEP_RECORDS = 256


_live_logs: weakref.WeakSet[CollectiveLog] = weakref.WeakSet()


def stop_all_heartbeats() -> None:
    """Stop every heartbeat thread (before the process group and its store go away)."""
    for log in list(_live_logs):
        log.close()


class CollectiveTimeoutError(EplError, TimeoutError):
    """A collective did not complete in time; the message names the operation and the missing ranks."""


class PeerLostError(EplError, ConnectionError):
    """A member of a collective went away (its connection closed); the message names the candidates."""


#: What gloo and NCCL say when a peer's process has gone.
PEER_GONE = ("closed by peer", "reset by peer", "Broken pipe", "Connection refused")


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective as this rank started it."""

    seq: int
    op: str
    numel: int
    dtype: str
    bytes: int
    started: float
    #: The other side's global rank, for a send or a receive (None for a collective).
    peer: int | None = None

    def describe(self) -> str:
        """``all_reduce #12 (1,024 x torch.float32)``, ``recv #8 (16 x torch.float32) from rank 1``."""
        side = "" if self.peer is None else f" {'to' if self.op == 'send' else 'from'} rank {self.peer}"
        return f"{self.op} #{self.seq} ({self.numel:,} x {self.dtype}){side}"


class CollectiveLog:
    """The numbered collectives of one communicator on this rank, published for diagnostics."""

    def __init__(self, name: str, rank: int, ranks: tuple[int, ...], store: dist.Store | None) -> None:
        """``rank`` is this process's global rank; ``ranks`` the members' global ranks."""
        self.name = name
        self.rank = rank
        self.ranks = ranks
        self.records: collections.deque[CollectiveRecord] = collections.deque(maxlen=KEEP_RECORDS)
        self.seq = 0
        self.bytes_sent = 0
        self._store = store
        self._published = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if store is not None:
            self._thread = threading.Thread(target=self._heartbeat, name=f"epl-heartbeat-{name}", daemon=True)
            self._thread.start()
            _live_logs.add(self)

    def start(self, op: str, tensor: torch.Tensor, peer: int | None = None) -> CollectiveRecord:
        """Number and record a collective (or a send or receive with the global rank ``peer``) that this rank is
        starting."""
        self.seq += 1
        nbytes = tensor.numel() * tensor.element_size()
        record = CollectiveRecord(self.seq, op, tensor.numel(), str(tensor.dtype), nbytes, time.monotonic(), peer)
        self.records.append(record)
        self.bytes_sent += nbytes
        return record

    def timeout_error(self, record: CollectiveRecord, waited: float) -> CollectiveTimeoutError:
        """The error for ``record`` not completing within ``waited`` seconds, naming who did not arrive."""
        progress = self._progress()
        missing = {rank: seen for rank, seen in progress.items() if seen is None or seen[0] < record.seq}
        if missing:
            who = "; ".join(
                f"rank {rank} " + ("never reported" if seen is None else f"is at #{seen[0]} ({seen[1]})")
                for rank, seen in sorted(missing.items())
            )
            detail = f"ranks {sorted(missing)} did not arrive: {who}"
        elif progress and record.peer is not None:
            seen = progress.get(record.peer)
            where = f" (it is at #{seen[0]} ({seen[1]}))" if seen is not None else ""
            detail = (
                f"ranks [{record.peer}] did not arrive at the other side of it{where}: rank {record.peer} is stuck "
                "outside communication (a loop, a deadlock, a slow step) or has died"
            )
        elif progress:
            detail = "every rank started it; a rank may have died or the network stalled"
        else:
            detail = (
                "no progress could be read from the other ranks (the job's store is unreachable: rank 0 may be gone)"
            )
        return CollectiveTimeoutError(
            f"{record.describe()} on communicator {self.name!r} (ranks {list(self.ranks)}) did not complete "
            f"within {waited:.0f}s on rank {self.rank}: {detail}. Every rank must run the same collectives in the "
            "same order; raise communication.timeout if the job is just slow."
        )

    def peer_lost_error(self, record: CollectiveRecord, cause: str) -> PeerLostError:
        """The error for ``record`` failing because a member's connection closed."""
        others = [rank for rank in self.ranks if rank != self.rank]
        who = f"rank {others[0]}" if len(others) == 1 else f"one of ranks {others}"
        return PeerLostError(
            f"{record.describe()} on communicator {self.name!r} (ranks {list(self.ranks)}) failed on rank "
            f"{self.rank}: {who} went away (the connection closed: {cause.strip()[:100]}). Its own error, or its "
            "launcher, says why it ended."
        )

    def close(self) -> None:
        """Stop the heartbeat."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * HEARTBEAT_SECONDS)

    # -- the store -------------------------------------------------------------------
    def _key(self, rank: int) -> str:
        return f"epl/progress/{self.name}/{rank}"

    def _publish(self) -> None:
        seq = self.seq
        if seq != self._published and self._store is not None:
            op = self.records[-1].op if self.records else "-"
            self._store.set(self._key(self.rank), f"{seq}:{op}")
            self._published = seq

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                self._publish()
            except Exception:  # noqa: BLE001 - the store is gone at shutdown; diagnostics are best effort
                return

    def _progress(self) -> dict[int, tuple[int, str] | None]:
        if self._store is None:
            return {}
        try:
            self._publish()
        except Exception:  # noqa: BLE001 - the store's host (rank 0) may be gone
            return {}
        progress: dict[int, tuple[int, str] | None] = {}
        for rank in self.ranks:
            key = self._key(rank)
            try:
                if not self._store.check([key]):
                    progress[rank] = None
                    continue
                seq, _, op = self._store.get(key).decode().partition(":")
                progress[rank] = (int(seq), op)
            except Exception:  # noqa: BLE001 - report what can be read
                progress[rank] = None
        return progress


class DiagnosedWork(Work):
    """A handle that knows its collective's record, so that a timeout can say who did not arrive."""

    def __init__(self, record: CollectiveRecord, log: CollectiveLog, timeout: float) -> None:
        self._record = record
        self._log = log
        self._timeout = timeout

    def seconds(self, timeout: float | None) -> float:
        """The wait's limit: ``timeout``, or the communicator's (``communication.timeout``)."""
        return self._timeout if timeout is None else timeout

    def timed_out(self, seconds: float) -> CollectiveTimeoutError:
        """The error for not completing within ``seconds``."""
        return self._log.timeout_error(self._record, seconds)

    def peer_lost(self, error: BaseException) -> PeerLostError | None:
        """The error naming the peers when ``error`` says a member's connection closed, else None."""
        text = str(error)
        return self._log.peer_lost_error(self._record, text) if any(sign in text for sign in PEER_GONE) else None
