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
from pathlib import Path

from epl_launch.config import GROUPS_DIR_VARIABLE, LaunchConfig, LaunchError, default_omp_threads
from epl_launch.local import Outcome
from epl_launch.output import RankOutput

#: The prefix epl_launch.mpi_worker puts on every line.
_PREFIX = re.compile(rb"^\[rank (\d+)\] ")


def _end_groups(folder: Path) -> None:
    """Kill what the targets left (mpiexec may kill a worker before it could), then forget the folder."""
    for record in folder.glob("*.pgid"):
        try:
            os.killpg(int(record.read_text()), signal.SIGKILL)
        except (ProcessLookupError, PermissionError, ValueError):
            pass
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


def run_mpi(config: LaunchConfig, master_port: int) -> Outcome:
    """Run the job under mpiexec: MPI places and numbers the processes, the rendezvous comes from here."""
    mpiexec = find_mpiexec()
    env = dict(os.environ)
    env.update(MASTER_ADDR=config.master_addr, MASTER_PORT=str(master_port), PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", default_omp_threads(config.world_size))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)  # MPI gives each process its own
    groups = Path(tempfile.mkdtemp(prefix="epl-launch-"))
    env[GROUPS_DIR_VARIABLE] = str(groups)
    output = RankOutput(config.log_dir)
    job = subprocess.Popen(
        mpi_command(config, mpiexec),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    assert job.stdout is not None
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: job.terminate())
    try:
        for data in iter(job.stdout.readline, b""):
            match = _PREFIX.match(data)
            if match:
                output.line(int(match.group(1)), data[match.end() :])
            else:
                sys.stdout.write(data.decode(errors="replace"))
                sys.stdout.flush()
        code = job.wait()
    except KeyboardInterrupt:
        job.terminate()
        code = job.wait()
        return Outcome(130, "epl launch: SIGINT received; mpiexec stopped every rank.")
    finally:
        signal.signal(signal.SIGTERM, previous)
        output.close()
        _end_groups(groups)
    if code != 0:
        where = f" Logs: {config.log_dir}." if config.log_dir is not None else ""
        return Outcome(code if code > 0 else 128 - code, f"epl launch: the MPI job failed with code {code}.{where}")
    return Outcome(0)
