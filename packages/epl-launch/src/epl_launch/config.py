"""The launch, as a typed config parsed from the flags before anything runs."""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from epl.plugin_api import EplError

#: Folder where each MPI worker writes its target's process group id (set by ``epl launch --mpi``).
GROUPS_DIR_VARIABLE = "EPL_LAUNCH_GROUPS_DIR"


class LaunchError(EplError):
    """The launch flags do not describe a job that can run."""


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """Everything ``epl launch`` needs: the job's shape, the rendezvous, logs and the target.

    ``nproc_per_node`` processes on each of ``num_workers`` machines; this launcher is
    machine ``machine_rank`` and starts global ranks ``machine_rank * nproc_per_node``
    onward. ``master_addr``/``master_port`` is the rendezvous (rank 0's machine).
    """

    nproc_per_node: int
    num_workers: int = 1
    machine_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    log_dir: Path | None = None
    mpi: bool = False
    grace_period: float = 5.0
    #: Run ``target`` as a Python module (``python -m target``), as ``torchrun -m`` does.
    module: bool = False
    #: Times the whole job is started again after a rank fails (torchrun's ``--max-restarts``).
    max_restarts: int = 0
    target: str
    target_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1 or self.num_workers < 1:
            raise LaunchError(
                f"--nproc-per-node ({self.nproc_per_node}) and --num-workers ({self.num_workers}) must be at least 1."
            )
        if not 0 <= self.machine_rank < self.num_workers:
            raise LaunchError(f"--machine-rank {self.machine_rank} is not in 0..{self.num_workers - 1}.")
        if self.num_workers > 1 and self.master_port is None:
            raise LaunchError(
                f"{self.num_workers} machines must agree on the rendezvous: give every launcher the same "
                "--master-addr (machine 0's address) and --master-port."
            )
        if self.max_restarts < 0:
            raise LaunchError(f"--max-restarts must be 0 or more, got {self.max_restarts}.")
        if self.mpi and self.num_workers > 1:
            raise LaunchError(
                "--mpi starts every process from this launcher; give mpiexec's host file instead of --num-workers."
            )

    @property
    def world_size(self) -> int:
        """Processes in the whole job."""
        return self.nproc_per_node * self.num_workers

    def global_rank(self, local_rank: int) -> int:
        """The global rank of this machine's ``local_rank``."""
        return self.machine_rank * self.nproc_per_node + local_rank

    def command(self) -> list[str]:
        """The argv of one worker: a module (``module``) or a Python file runs under this Python, a shell
        script under bash, anything else as a command (no shell)."""
        if self.module:
            return [sys.executable, "-u", "-m", self.target, *self.target_args]
        if self.target.endswith(".py"):
            return [sys.executable, "-u", self.target, *self.target_args]
        if self.target.endswith(".sh"):
            return ["bash", self.target, *self.target_args]
        return [self.target, *self.target_args]


def machine_from_list(machine_list: str) -> tuple[int, int, str]:
    """(num_workers, this machine's rank, master address) from the manual's ``--machine_list host1,host2``."""
    hosts = [h.strip() for h in machine_list.split(",") if h.strip()]
    if not hosts:
        raise LaunchError("--machine-list is empty; give machine addresses separated by commas.")
    names = _local_names()
    mine = [index for index, host in enumerate(hosts) if host in names]
    if len(mine) != 1:
        raise LaunchError(
            f"Cannot tell which of --machine-list {hosts} is this machine ({sorted(names)}); give --machine-rank."
        )
    return len(hosts), mine[0], hosts[0]


def default_nproc_per_node() -> int:
    """One process per visible GPU (CUDA_VISIBLE_DEVICES, else the NVIDIA driver's list), or 1 without GPUs.

    Read without importing PyTorch, so that the launcher starts fast.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return max(1, len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"]))
    gpus = Path("/proc/driver/nvidia/gpus")
    return max(1, len(list(gpus.iterdir()))) if gpus.is_dir() else 1


def default_omp_threads(nproc_per_node: int) -> str:
    """CPU threads per process when OMP_NUM_THREADS is not given: the cores shared out, at least 1."""
    return str(max(1, (os.cpu_count() or 1) // nproc_per_node))


def _local_names() -> set[str]:
    names = {"localhost", "127.0.0.1", socket.gethostname(), socket.getfqdn()}
    try:
        names.update(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        pass
    return names
