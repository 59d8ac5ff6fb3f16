"""Start this machine's workers, watch them, and end the whole job when one fails."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from epl_launch.config import LaunchConfig, default_omp_threads
from epl_launch.output import RankOutput, terminal_environment
from epl_launch.processes import signal_group
from epl_launch.tracebacks import error_of, failed_lines, ranks_text

#: Seconds between two looks at the workers.
POLL_SECONDS = 0.05
#: Seconds to let other ranks fail after the first failure, to tell the cause from its consequences.
SETTLE_SECONDS = 1.0
#: Output of a rank that failed because a peer went away.
PEER_LOST = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|did not arrive|CollectiveTimeoutError|"
    r"NCCL communicator was aborted|ProcessGroupGloo|DistNetworkError|DistBackendError|"
    r"went away \(the connection closed"
)
#: EPL's timeout diagnosis: the ranks a collective waited for.
LATE_RANKS = re.compile(r"ranks \[([\d, ]+)\] did not arrive")
#: Signals that end the whole job (HUP: the terminal or ssh session went away).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class Outcome:
    """How the job ended: the exit code for the launcher, a message for the user (or None), and whether a
    signal ended it (then it is not restarted)."""

    exit_code: int
    message: str | None = None
    interrupted: bool = False


def restart_environment(config: LaunchConfig, restart: int) -> dict[str, str]:
    """How a worker tells which start of the job it is in: ``EPL_RESTART_COUNT`` (0 the first time), and
    torchrun's names for it and for ``--max-restarts``."""
    return {
        "EPL_RESTART_COUNT": str(restart),
        "TORCHELASTIC_RESTART_COUNT": str(restart),
        "TORCHELASTIC_MAX_RESTARTS": str(config.max_restarts),
    }


def worker_environment(config: LaunchConfig, local_rank: int, master_port: int, restart: int = 0) -> dict[str, str]:
    """What one worker finds in its environment: everything ``epl.init`` (or torch) needs."""
    env = dict(os.environ)
    env.update(
        RANK=str(config.global_rank(local_rank)),
        WORLD_SIZE=str(config.world_size),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(config.nproc_per_node),
        GROUP_RANK=str(config.machine_rank),
        NODE_RANK=str(config.machine_rank),
        MASTER_ADDR=config.master_addr,
        MASTER_PORT=str(master_port),
        EPL_LAUNCHER="epl",
        EPL_LAUNCHER_PID=str(os.getpid()),
        PYTHONUNBUFFERED="1",
    )
    env.setdefault("OMP_NUM_THREADS", default_omp_threads(config.nproc_per_node))
    # Every rank orders sets of strings alike: a forward that loops over a set calls its modules in one order
    # on every rank (transformers' Gemma 3 and OLMo 3 loop over set(config.layer_types)), as pipelines need.
    env.setdefault("PYTHONHASHSEED", "0")
    env.update(terminal_environment(config.global_rank(local_rank)))
    env.update(restart_environment(config, restart))
    return env


class LocalJob:
    """This machine's ``nproc_per_node`` workers, each in its own process group."""

    def __init__(self, config: LaunchConfig, master_port: int, restart: int = 0) -> None:
        self.config = config
        self.master_port = master_port
        self.restart = restart
        first = config.global_rank(0)
        self.output = RankOutput(config.log_dir, range(first, first + config.nproc_per_node), restart=restart)
        self.workers: list[subprocess.Popen[bytes]] = []
        self._readers: list[threading.Thread] = []
        self._interrupted: int | None = None
        #: (local rank, exit code) of every rank that failed, once one has.
        self._failed: list[tuple[int, int]] = []

    def run(self) -> Outcome:
        """Start the workers and wait: all succeed (0), one fails (its code), or a signal ends the job."""
        # Handled until every worker is gone: a second Ctrl-C must not cut the shutdown short.
        previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        outcome = Outcome(1)
        try:
            self._start()
            outcome = self._watch()
        finally:
            self._stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            for reader in self._readers:
                reader.join(timeout=5)
            try:
                if self._failed:  # told once every rank's output is in: the errors they printed last
                    outcome = self._describe(self._failed)
            finally:
                self.output.close(show_held=not self._failed)
        return outcome

    def _start(self) -> None:
        for local_rank in range(self.config.nproc_per_node):
            try:
                worker = subprocess.Popen(
                    self.config.command(),
                    env=worker_environment(self.config, local_rank, self.master_port, self.restart),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # its own process group: ended with all its children
                )
            except FileNotFoundError:
                raise SystemExit(f"epl launch: cannot run {self.config.target!r}: no such file or command") from None
            except PermissionError:
                raise SystemExit(
                    f"epl launch: cannot run {self.config.target!r}: not executable (a Python file needs the .py "
                    "suffix, a shell script .sh; otherwise chmod +x it)"
                ) from None
            self.workers.append(worker)
            assert worker.stdout is not None
            self._readers.append(self.output.follow(self.config.global_rank(local_rank), worker.stdout))

    def _watch(self) -> Outcome:
        while True:
            if self._interrupted is not None:
                name = signal.Signals(self._interrupted).name
                return Outcome(
                    128 + self._interrupted, f"epl launch: {name} received; stopped every rank.", interrupted=True
                )
            codes = [worker.poll() for worker in self.workers]
            if any(code not in (None, 0) for code in codes):
                self._failed = self._settle()
                return Outcome(1)  # described once the ranks are stopped (run)
            if all(code == 0 for code in codes):
                return Outcome(0)
            self.output.release()  # tracebacks of ranks that went on after printing them
            time.sleep(POLL_SECONDS)

    def _settle(self) -> list[tuple[int, int]]:
        """Every rank that failed, after a moment for the failures to settle: ranks whose peer died fail too,
        sometimes first."""
        deadline = time.monotonic() + SETTLE_SECONDS
        while time.monotonic() < deadline and any(w.poll() is None for w in self.workers):
            time.sleep(POLL_SECONDS)
        return [(i, w.returncode) for i, w in enumerate(self.workers) if w.returncode not in (None, 0)]

    def _peer_lost(self, local_rank: int) -> bool:
        recent = "".join(self.output.recent.get(self.config.global_rank(local_rank), ()))
        return PEER_LOST.search(recent) is not None

    def _describe(self, failed: list[tuple[int, int]]) -> Outcome:
        """Say what failed, once: the error each causing rank raised (not the errors of the ranks that only lost
        their connection to it), then the rank that caused it, how it ended, and its log."""
        causes = [(i, code) for i, code in failed if not self._peer_lost(i)] or failed
        local_rank, code = causes[0]
        rank = self.config.global_rank(local_rank)
        errors = {
            self.config.global_rank(i): error_of(self.output.tracebacks.get(self.config.global_rank(i), ()))
            for i, _ in causes
        }
        said = failed_lines(errors)
        if code < 0:
            how, exit_code = f"was killed by {signal.Signals(-code).name}", 128 - code
        else:
            how, exit_code = f"exited with code {code}", code
        where = self._logs([r for r, error in errors.items() if error is not None and error == errors[rank]] or [rank])
        late = LATE_RANKS.findall("".join(self.output.recent.get(rank, ())))
        if late:  # the rank that failed only reported the one that stopped arriving
            who = ranks_text(late[-1].split(", "))
            said.append(
                f"epl launch: {who} stopped taking part in collectives: rank {rank}'s collective timed out "
                f"waiting for it and {how}{where}. Stopped the other ranks."
            )
        else:
            said.append(f"epl launch: rank {rank} {how}{where}. Stopped the other ranks.")
        return Outcome(exit_code, "\n".join(said))

    def _logs(self, ranks: list[int]) -> str:
        """``; its log: PATH`` (the first of ``ranks``), with the logs of the others that raised the same error."""
        paths = [self.output.log_path(rank) for rank in ranks]
        if paths[0] is None:
            return ""
        others = ", ".join(f"rank {rank}'s: {path}" for rank, path in zip(ranks[1:], paths[1:], strict=True))
        return f"; its log: {paths[0]}" + (f" ({others})" if others else "")

    def _on_signal(self, signum: int, frame: object) -> None:
        self._interrupted = signum

    def _stop_all(self) -> None:
        """TERM every worker's process group, then KILL what is left after the grace period."""
        alive = [w for w in self.workers if w.poll() is None]
        for worker in alive:
            signal_group(worker.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.config.grace_period
        for worker in alive:
            try:
                worker.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for worker in self.workers:
            signal_group(worker.pid, signal.SIGKILL)  # also any child a finished worker left behind
            worker.wait()


def report(outcome: Outcome) -> int:
    """Print the outcome's message (if any) to stderr and return its exit code."""
    if outcome.message:
        print(outcome.message, file=sys.stderr, flush=True)
    return outcome.exit_code
