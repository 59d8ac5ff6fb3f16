"""Each rank's output: shown live with a ``[rank N]`` prefix, and kept whole in a log file per rank.

A rank's line is shown when its newline arrives. A progress bar redraws one line with carriage
returns (``\\r``) and no newline: when the launcher's output is a terminal, the latest such
redraw is shown in place as the *status line* (the ranks are told with ``EPL_LAUNCH_TERMINAL``,
see :func:`terminal_environment`), cleared before other lines and drawn again after them.
Elsewhere (a pipe, a file) only whole lines are written, a redrawn line in its last state.

A traceback (``Traceback (most recent call last):`` and what follows) goes to the rank's log
at once but is *held* from the terminal: when the rank ends with it, the launcher shows its
error once (:mod:`epl_launch.tracebacks`), not every rank's whole traceback. When the rank
goes on instead (an error it caught and logged), the launcher shows the held lines
``HOLD_SECONDS`` after the traceback began, in order (:meth:`RankOutput.release`).
"""

from __future__ import annotations

import collections
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import IO

from epl.plugin_api import LAUNCH_TERMINAL_VARIABLE
from epl_launch.tracebacks import starts_traceback

#: Lines of each rank's output kept in memory (to tell a failure's cause from its consequences).
RECENT_LINES = 50
#: Bytes read from a rank's output at a time (whatever is there, up to this).
READ_BYTES = 65536
#: Seconds a traceback is held from the terminal while its rank still runs; then it is shown as printed.
HOLD_SECONDS = 3.0
#: Moves to the start of the line and clears it.
CLEAR_LINE = "\r\x1b[K"


def prefix(rank: int) -> str:
    """What starts every line of ``rank``'s output."""
    return f"[rank {rank}] "


def terminal_environment(rank: int) -> dict[str, str]:
    """What a rank needs to draw a bar through the launcher: nothing unless the launcher writes to a terminal;
    then ``EPL_LAUNCH_TERMINAL=1`` and ``COLUMNS``, the terminal's width less the rank prefix."""
    if not sys.stdout.isatty():
        return {}
    width = shutil.get_terminal_size().columns - len(prefix(rank))
    return {LAUNCH_TERMINAL_VARIABLE: "1", "COLUMNS": str(max(width, 20))}


class RankOutput:
    """Writes lines to the terminal (prefixed) and to per-rank log files; one lock for the terminal."""

    def __init__(self, log_dir: Path | None, ranks: range, terminal: bool | None = None, restart: int = 0) -> None:
        self.log_dir = log_dir
        self.terminal = sys.stdout.isatty() if terminal is None else terminal
        self._lock = threading.Lock()
        self._logs: dict[int, IO[bytes]] = {}
        self._status = ""  # the status line on screen (with its prefix), or ""
        self._status_rank: int | None = None
        self.recent: dict[int, collections.deque[str]] = {
            rank: collections.deque(maxlen=RECENT_LINES) for rank in ranks
        }
        #: Each rank's last traceback (from its first line on), shown or not.
        self.tracebacks: dict[int, list[str]] = {}
        self._held: dict[int, list[str]] = {}  # lines not shown yet, from a traceback's first line on
        self._held_since: dict[int, float] = {}  # when each held block began
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            for rank in ranks:  # a fresh, existing log per rank, even for a rank that prints nothing; a restart adds
                self._logs[rank] = open(log_dir / f"rank_{rank}.log", "ab" if restart else "wb")  # noqa: SIM115
                if restart:
                    self._logs[rank].write(f"== epl launch: restart {restart} ==\n".encode())

    def log_path(self, rank: int) -> Path | None:
        """Where rank ``rank``'s full output is kept."""
        return self.log_dir / f"rank_{rank}.log" if self.log_dir is not None else None

    def line(self, rank: int, data: bytes) -> None:
        """One line (with its newline) that rank ``rank`` wrote; a line redrawn with ``\\r`` counts in its last
        state."""
        log = self._logs.get(rank)
        text = data.decode(errors="replace").rstrip("\n").rsplit("\r", 1)[-1]
        if log is not None:
            log.write(text.encode() + b"\n")
            log.flush()
        if rank in self.recent:
            self.recent[rank].append(text + "\n")
        with self._lock:
            if rank in self._held or starts_traceback(text):
                if rank not in self._held:
                    self.tracebacks[rank] = []
                    self._held_since[rank] = time.monotonic()
                self._held.setdefault(rank, []).append(text)
                self.tracebacks[rank].append(text)
                return
            self._write(rank, text)

    def _write(self, rank: int, text: str) -> None:
        """Show one line of ``rank``'s on the terminal, prefixed (the lock held)."""
        clear = CLEAR_LINE if self._status else ""
        if rank == self._status_rank:  # the rank's own line replaces its redrawn one
            self._status, self._status_rank = "", None
        sys.stdout.write(f"{clear}{prefix(rank)}{text}\n{self._status}")
        sys.stdout.flush()

    def release(self, age: float | None = HOLD_SECONDS) -> None:
        """Show the tracebacks held for ``age`` seconds or more (None: all of them), as printed, with the lines
        held after them: their rank went on after printing them."""
        now = time.monotonic()
        with self._lock:
            for rank in [r for r, since in self._held_since.items() if age is None or now - since >= age]:
                for text in self._held.pop(rank):
                    self._write(rank, text)
                del self._held_since[rank]

    def status(self, rank: int, text: str) -> None:
        """Rank ``rank`` redrew its current line as ``text``: show it in place (on a terminal only)."""
        if not self.terminal or not text:
            return
        with self._lock:
            self._status, self._status_rank = f"{prefix(rank)}{text}", rank
            sys.stdout.write(CLEAR_LINE + self._status)
            sys.stdout.flush()

    def follow(self, rank: int, stream: IO[bytes]) -> threading.Thread:
        """Copy ``stream`` in a background thread until it closes: whole lines, and redraws as the status line."""

        def copy() -> None:
            pending = b""
            read = getattr(stream, "read1", stream.read)
            for chunk in iter(lambda: read(READ_BYTES), b""):
                *lines, pending = (pending + chunk).split(b"\n")
                for data in lines:
                    self.line(rank, data + b"\n")
                if b"\r" in pending:
                    pending = b"\r" + pending.rsplit(b"\r", 1)[-1]  # only the latest redraw matters
                    self.status(rank, pending[1:].decode(errors="replace"))
            if pending:
                self.line(rank, pending)
            stream.close()

        thread = threading.Thread(target=copy, name=f"epl-launch-output-{rank}", daemon=True)
        thread.start()
        return thread

    def close(self, *, show_held: bool = True) -> None:
        """Close the log files; ``show_held``: show the tracebacks still held first (when the job did not fail: the
        ranks caught those errors), else leave them to the logs (the launcher has said what failed)."""
        if show_held:
            self.release(None)
        self._held.clear()
        self._held_since.clear()
        for log in self._logs.values():
            log.close()
        self._logs.clear()
