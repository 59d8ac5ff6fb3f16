"""Run a function on several real processes (one per rank) and collect what each returned.

Each rank is a fresh process with the environment ``epl launch`` and torchrun set (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and
``OMP_NUM_THREADS=1``. Its stdout and stderr (Python and C level) go to a log file per
rank. When any rank fails, or the ranks do not finish within ``timeout`` seconds, every
rank is stopped and the error shows each rank's exit code, traceback and the end of its log.

The processes are forked from a ``forkserver`` that has imported torch, transformers' common
models and EPL once (:data:`PRELOADED`), not ``spawn``ed: a spawned rank spent about 4 s of
CPU importing them, and the suite starts several hundred ranks on 2 cores. Each rank is still
a new process that never ran anything (the server only imports), with the calling process's
environment and working directory as of the call, as a spawned one would have. A call made
while a glibc ``MALLOC_`` setting is in the environment forks its ranks from a second server, started
with those settings: glibc reads them only when a process starts, and a fork keeps what they set
(``benchmarks.resident.allocation_tracking_children``).
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.popen_forkserver
import multiprocessing.process
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epl.ports import free_port

#: Lines of each rank's log shown in a failure report.
LOG_TAIL_LINES = 40
#: Seconds between SIGTERM and SIGKILL when stopping ranks.
GRACE_SECONDS = 5.0
#: What the fork server imports once, so that each rank it forks starts with it (a name that fails to import is
#: skipped by the server, and the rank imports it itself).
PRELOADED = [
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "pytest",
    "epl",
    "epl.plugin_api",
    "epl_comm.plugin",
    "epl_memory.plugin",
    "epl_pipeline.plugin",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gpt2.modeling_gpt2",
]


class DistributedTestError(AssertionError):
    """One or more ranks failed or timed out; the message has every rank's report."""


@dataclass
class RankReport:
    """What one rank left behind."""

    rank: int
    exitcode: int | None
    value: Any = None
    error: str | None = None
    failed_at: float = float("inf")
    log: str = ""

    def describe(self) -> str:
        """A readable block for failure messages."""
        status = "still running (killed)" if self.exitcode is None else f"exit code {self.exitcode}"
        lines = [f"--- rank {self.rank}: {status} ---"]
        if self.error:
            lines.append(self.error.rstrip())
        tail = self.log.rstrip().splitlines()[-LOG_TAIL_LINES:]
        if tail:
            lines.append("log (last lines):")
            lines += [f"  | {line}" for line in tail]
        return "\n".join(lines)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Call ``fn(*args)`` on ``world_size`` processes; return each rank's result, by rank.

    ``fn`` must be importable (defined at module level). ``env`` adds environment
    variables for every rank. Raises :class:`DistributedTestError` when a rank
    raises, exits non-zero, or the job exceeds ``timeout`` seconds.
    """
    # Sets of strings in the same order on every rank, as epl launch gives them (a forward looping over a set).
    # Before the fork server starts: an interpreter reads it when it starts.
    os.environ.setdefault("PYTHONHASHSEED", "0")
    context = _process_context()
    caller = (dict(os.environ), os.getcwd())
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="epl-ranks-") as folder:
        workdir = Path(folder)
        processes = []
        for rank in range(world_size):
            process = context.Process(
                target=_rank_main,
                args=(fn, rank, world_size, port, str(workdir), args, dict(env or {}), caller),
                name=f"rank{rank}",
            )
            process.start()
            processes.append(process)
        deadline = time.monotonic() + timeout
        failed_early = False
        try:
            while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
                if any(p.exitcode not in (None, 0) for p in processes):
                    failed_early = True
                    break
                time.sleep(0.05)
        except BaseException:  # the test's own timeout (pytest-timeout), Ctrl-C: leave no rank running
            _stop(processes)
            raise
        timed_out = not failed_early and any(p.is_alive() for p in processes)
        running = [rank for rank, p in enumerate(processes) if p.is_alive()]
        _stop(processes)
        reports = [
            _report(rank, p.exitcode if rank not in running else None, workdir) for rank, p in enumerate(processes)
        ]
    if timed_out:
        raise DistributedTestError(
            f"{world_size} ranks did not finish within {timeout:.0f}s; still running: ranks {running}\n"
            + "\n".join(r.describe() for r in reports)
        )
    bad = [r for r in reports if r.error is not None or r.exitcode != 0]
    if bad:
        first = min(bad, key=lambda r: r.failed_at)
        raise DistributedTestError(
            f"ranks {[r.rank for r in bad]} of {world_size} failed, rank {first.rank} first\n"
            + "\n".join(r.describe() for r in reports)
        )
    return [r.value for r in reports]


def init_gloo(timeout_seconds: float = 60.0) -> None:
    """Join the default torch.distributed process group on gloo, with a collective timeout."""
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_seconds))


def _process_context() -> Any:
    """What makes the ranks' processes: the fork server's context (started on first use, with :data:`PRELOADED`),
    or, while a glibc ``MALLOC_`` setting is in the environment, a second fork server's, started with it."""
    settings = tuple(sorted((key, value) for key, value in os.environ.items() if key.startswith("MALLOC_")))
    if settings:
        _malloc_server(settings)
        return _ServerContext(settings)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOADED)
    return context


#: The fork servers started with glibc settings, by those settings.
_MALLOC_SERVERS: dict[tuple[tuple[str, str], ...], multiprocessing.forkserver.ForkServer] = {}


def _malloc_server(settings: tuple[tuple[str, str], ...]) -> multiprocessing.forkserver.ForkServer:
    """A fork server of its own for ``settings`` (it starts at its first fork, with the environment of then)."""
    if settings not in _MALLOC_SERVERS:
        server = multiprocessing.forkserver.ForkServer()
        server.set_forkserver_preload(PRELOADED)
        _MALLOC_SERVERS[settings] = server
    return _MALLOC_SERVERS[settings]


class _ServerContext:
    """A ``multiprocessing`` context whose ``Process`` forks from the server for ``settings``."""

    def __init__(self, settings: tuple[tuple[str, str], ...]) -> None:
        self.settings = settings

    def Process(self, **options: Any) -> _ServerProcess:  # noqa: N802 - a context's name
        process = _ServerProcess(**options)
        process.settings = self.settings
        return process


class _ServerPopen(multiprocessing.popen_forkserver.Popen):
    """A fork server's process, asked of the server for the process's settings."""

    def _launch(self, process_obj: Any) -> None:
        with _forking_from(_MALLOC_SERVERS[process_obj.settings]):
            super()._launch(process_obj)


class _ServerProcess(multiprocessing.process.BaseProcess):
    """A process forked by the server for its ``settings`` (pickled with it, so defined at module level)."""

    _start_method = "forkserver"
    settings: tuple[tuple[str, str], ...] = ()

    @staticmethod
    def _Popen(process_obj: Any) -> Any:  # noqa: N802 - multiprocessing's name
        return _ServerPopen(process_obj)


@contextlib.contextmanager
def _forking_from(server: multiprocessing.forkserver.ForkServer) -> Iterator[None]:
    """``multiprocessing.popen_forkserver`` asks ``server`` for its next process (it asks the module's function)."""
    module = multiprocessing.forkserver
    default = module.connect_to_new_process
    module.connect_to_new_process = server.connect_to_new_process  # type: ignore[assignment]
    try:
        yield
    finally:
        module.connect_to_new_process = default  # type: ignore[assignment]


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    workdir: str,
    args: tuple[Any, ...],
    env: dict[str, str],
    caller: tuple[dict[str, str], str],
) -> None:
    environment, directory = caller  # the caller's, as of the call (a forked rank has the server's)
    os.environ.clear()
    os.environ.update(environment)
    os.chdir(directory)
    log = open(Path(workdir) / f"rank{rank}.log", "w", buffering=1)  # noqa: SIM115 - lives as long as the process
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            **env,
        }
    )
    result: dict[str, Any]
    try:
        import torch

        torch.set_num_threads(1)
        result = {"value": fn(*args)}
    except BaseException:
        result = {"error": traceback.format_exc(), "failed_at": time.time()}
    finally:
        _destroy_process_group()
    with open(Path(workdir) / f"rank{rank}.pkl", "wb") as file:
        pickle.dump(result, file)
    log.flush()
    sys.exit(1 if "error" in result else 0)


def _destroy_process_group() -> None:
    try:
        import epl

        if epl.Env._current is not None:
            epl.Env._current.close()
    except Exception:  # noqa: BLE001 - best effort at exit
        pass
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort at exit
        pass


def _stop(processes: list[multiprocessing.process.BaseProcess]) -> None:
    for process in processes:
        if process.is_alive() and process.pid is not None:
            os.kill(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()


def _report(rank: int, exitcode: int | None, workdir: Path) -> RankReport:
    log_file = workdir / f"rank{rank}.log"
    log = log_file.read_text(errors="replace") if log_file.exists() else ""
    report = RankReport(rank=rank, exitcode=exitcode, log=log)
    result_file = workdir / f"rank{rank}.pkl"
    if result_file.exists():
        result = pickle.loads(result_file.read_bytes())
        report.value = result.get("value")
        report.error = result.get("error")
        report.failed_at = result.get("failed_at", float("inf"))
    elif exitcode is not None and exitcode != 0:
        report.error = f"rank {rank} died without a result (exit code {exitcode})"
    return report
