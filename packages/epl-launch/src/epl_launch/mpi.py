"""``epl launch --mpi``: the same job started by ``mpiexec`` (MPICH's hydra or Open MPI)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from epl_launch.config import GROUPS_DIR_VARIABLE, LaunchConfig, LaunchError, default_omp_threads
from epl_launch.local import POLL_SECONDS, STOP_SIGNALS, Outcome, restart_environment
from epl_launch.output import RankOutput
from epl_launch.processes import signal_group
from epl_launch.tracebacks import error_of, failed_lines

#: The prefix epl_launch.mpi_worker puts on every line.
_PREFIX = re.compile(rb"^\[rank (\d+)\] ")


def _end_groups(folder: Path) -> None:
    """Kill what the targets left (mpiexec may kill a worker before it could), then forget the folder."""
    for record in folder.glob("*.pgid"):
        text = record.read_text().strip()
        if text.isdigit():  # a worker killed while writing it leaves it empty
            signal_group(int(text), signal.SIGKILL)
    shutil.rmtree(folder, ignore_errors=True)


def find_mpiexec() -> str:
    """mpiexec beside this Python (the mpich wheel puts it there) or on the PATH; mpi4py must be importable."""
    if importlib.util.find_spec("mpi4py") is None:
        raise LaunchError("--mpi needs mpi4py: pip install 'epl-launch[mpi]' (mpi4py and the mpich wheel).")
    found = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
    if found is None:
        raise LaunchError(
            "--mpi needs mpiexec: pip install 'epl-launch[mpi]' (mpi4py and the mpich wheel), or any MPI."
        )
    return found


def mpi_command(config: LaunchConfig, mpiexec: str) -> list[str]:
    """mpiexec starting ``epl_launch.mpi_worker`` around the target on every process."""
    worker = [sys.executable, "-u", "-m", "epl_launch.mpi_worker"]
    return [mpiexec, "-n", str(config.world_size), *worker, *config.command()]


def run_mpi(config: LaunchConfig, master_port: int, restart: int = 0) -> Outcome:
    """Run the job under mpiexec: MPI places and numbers the processes, the rendezvous comes from here."""
    mpiexec = find_mpiexec()
    env = dict(os.environ)
    env.update(MASTER_ADDR=config.master_addr, MASTER_PORT=str(master_port), PYTHONUNBUFFERED="1")
    env.update(restart_environment(config, restart))
    env.setdefault("OMP_NUM_THREADS", default_omp_threads(config.world_size))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)  # MPI gives each process its own
    groups = Path(tempfile.mkdtemp(prefix="epl-launch-"))
    env[GROUPS_DIR_VARIABLE] = str(groups)
    output = RankOutput(config.log_dir, range(config.world_size), restart=restart)
    stop: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: stop.append(signum)) for sig in STOP_SIGNALS}
    job = subprocess.Popen(
        mpi_command(config, mpiexec),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    reader = threading.Thread(target=_copy_output, args=(job, output), daemon=True)
    reader.start()
    failed = False
    try:
        while job.poll() is None and not stop:
            output.release()  # tracebacks of ranks that went on after printing them
            time.sleep(POLL_SECONDS)
        if stop:
            _stop(job, config.grace_period)
            name = signal.Signals(stop[0]).name
            return Outcome(128 + stop[0], f"epl launch: {name} received; mpiexec stopped every rank.", interrupted=True)
        reader.join(timeout=5)
        failed = job.returncode != 0
        return _mpi_outcome(job.returncode, groups, output)
    finally:
        _end_groups(groups)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        output.close(show_held=not failed)


def _copy_output(job: subprocess.Popen[bytes], output: RankOutput) -> None:
    assert job.stdout is not None
    for data in iter(job.stdout.readline, b""):
        match = _PREFIX.match(data)
        if match:
            output.line(int(match.group(1)), data[match.end() :])
        else:
            sys.stdout.write(data.decode(errors="replace"))
            sys.stdout.flush()


def _stop(job: subprocess.Popen[bytes], grace_period: float) -> None:
    job.terminate()
    try:
        job.wait(timeout=grace_period)
    except subprocess.TimeoutExpired:
        job.kill()
        job.wait()


def _mpi_outcome(code: int, groups: Path, output: RankOutput) -> Outcome:
    if code == 0:
        return Outcome(0)
    failures = sorted(
        (float(when), int(rank_code), int(path.stem[4:]))
        for path in groups.glob("rank*.failed")
        for when, rank_code in [path.read_text().split()]
    )
    exit_code = code if code > 0 else 128 - code
    if not failures:
        return Outcome(exit_code, f"epl launch: the MPI job failed with code {code}.")
    _, rank_code, rank = failures[0]
    log = output.log_path(rank)
    where = f"; its log: {log}" if log is not None else ""
    said = failed_lines({rank: error_of(output.tracebacks.get(rank, ()))})
    said.append(f"epl launch: rank {rank} exited with code {rank_code}{where}. mpiexec stopped the other ranks.")
    return Outcome(rank_code, "\n".join(said))
