"""Each rank's output: shown live with a ``[rank N]`` prefix, and kept whole in a log file per rank."""

from __future__ import annotations

import collections
import sys
import threading
from pathlib import Path
from typing import IO

#: Lines of each rank's output kept in memory (to tell a failure's cause from its consequences).
RECENT_LINES = 50


class RankOutput:
    """Writes lines to the terminal (prefixed) and to per-rank log files; one lock for the terminal."""

    def __init__(self, log_dir: Path | None, ranks: range) -> None:
        self.log_dir = log_dir
        self._lock = threading.Lock()
        self._logs: dict[int, IO[bytes]] = {}
        self.recent: dict[int, collections.deque[str]] = {
            rank: collections.deque(maxlen=RECENT_LINES) for rank in ranks
        }
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            for rank in ranks:  # a fresh, existing log per rank, even for a rank that prints nothing
                self._logs[rank] = open(log_dir / f"rank_{rank}.log", "wb")  # noqa: SIM115 - closed in close()

    def log_path(self, rank: int) -> Path | None:
        """Where rank ``rank``'s full output is kept."""
        return self.log_dir / f"rank_{rank}.log" if self.log_dir is not None else None

    def line(self, rank: int, data: bytes) -> None:
        """One line (with its newline) that rank ``rank`` wrote."""
        log = self._logs.get(rank)
        if log is not None:
            log.write(data)
            log.flush()
        text = data.decode(errors="replace")
        if rank in self.recent:
            self.recent[rank].append(text)
        if not text.endswith("\n"):
            text += "\n"
        with self._lock:
            sys.stdout.write(f"[rank {rank}] {text}")
            sys.stdout.flush()

    def follow(self, rank: int, stream: IO[bytes]) -> threading.Thread:
        """Copy ``stream`` line by line in a background thread until it closes."""

        def copy() -> None:
            for data in iter(stream.readline, b""):
                self.line(rank, data)
            stream.close()

        thread = threading.Thread(target=copy, name=f"epl-launch-output-{rank}", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        """Close the log files."""
        for log in self._logs.values():
            log.close()
        self._logs.clear()
