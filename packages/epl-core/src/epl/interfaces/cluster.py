"""The processes of a job and this process's place among them, read from the environment."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from epl.errors import ClusterError
from epl.interfaces.slurm import slurm_step
from epl.ports import free_port

#: (world size, rank, local rank, local world size) variables of each MPI flavour.
_MPI_VARIABLES = (
    ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("PMIX_SIZE", "PMIX_RANK", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"),
)


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Where this process stands in the job.

    ``world_size`` processes in all, one device each, ``gpu_per_worker`` of them
    on each of ``num_workers`` nodes (the manual's names). ``total_gpu_num`` is
    the number of devices of the job: GPUs on a GPU cluster, processes on CPU.
    """

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    launcher: str = "none"
    device_type: str = "cpu"
    device_index: int | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ClusterError(f"WORLD_SIZE must be at least 1, got {self.world_size}.")
        if not 0 <= self.rank < self.world_size:
            raise ClusterError(
                f"RANK {self.rank} is outside the world of {self.world_size} processes (0..{self.world_size - 1})."
            )
        if not 0 <= self.local_rank < self.local_world_size:
            raise ClusterError(
                f"LOCAL_RANK {self.local_rank} is outside the {self.local_world_size} processes of this node."
            )
        if self.world_size % self.local_world_size:
            raise ClusterError(
                f"WORLD_SIZE {self.world_size} is not a multiple of LOCAL_WORLD_SIZE {self.local_world_size}: "
                "every node must run the same number of processes."
            )

    # -- the manual's names ----------------------------------------------------------
    @property
    def total_gpu_num(self) -> int:
        """Devices in the job (one per process)."""
        return self.world_size

    @property
    def gpu_per_worker(self) -> int:
        """Devices (processes) per node."""
        return self.local_world_size

    @property
    def num_workers(self) -> int:
        """Nodes in the job."""
        return self.world_size // self.local_world_size

    @property
    def worker_index(self) -> int:
        """Index of this process's node."""
        return self.rank // self.local_world_size

    @property
    def device(self) -> torch.device:
        """The device this process computes on."""
        if self.device_index is None:
            return torch.device(self.device_type)
        return torch.device(self.device_type, self.device_index)

    # -- construction ----------------------------------------------------------------
    @classmethod
    def from_environ(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        visible_devices: str = "",
        cuda_available: bool | None = None,
    ) -> Cluster:
        """Read the cluster set by ``epl launch``, torchrun or an MPI launcher.

        ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` win; otherwise the
        variables of Open MPI, MPICH (hydra) or PMIx, asking mpi4py for the ranks within
        the node when the launcher does not export them, and for rank 0's address and a
        free port when MASTER_ADDR/MASTER_PORT are not set; otherwise Slurm's, for a task of
        ``srun`` (:mod:`epl.interfaces.slurm`); otherwise one local process.
        ``visible_devices`` is ``cluster.run_visible_devices``: local rank i uses the
        i-th listed CUDA device. Without CUDA every process computes on the CPU.
        """
        environ = os.environ if environ is None else environ
        if "WORLD_SIZE" in environ or "RANK" in environ:
            world, rank = _int(environ, "WORLD_SIZE", 1), _int(environ, "RANK", 0)
            local_world = _int(environ, "LOCAL_WORLD_SIZE", world)
            local_rank = _int(environ, "LOCAL_RANK", rank % local_world if local_world > 0 else rank)
            launcher = environ.get("EPL_LAUNCHER", "torchrun")
        else:
            world, rank, local_rank, local_world, launcher = 1, 0, 0, 1, "none"
            for size_var, rank_var, local_rank_var, local_size_var in _MPI_VARIABLES:
                if size_var in environ and rank_var in environ:
                    world, rank = _int(environ, size_var, 1), _int(environ, rank_var, 0)
                    if local_rank_var in environ and local_size_var in environ:
                        local_rank, local_world = _int(environ, local_rank_var, 0), _int(environ, local_size_var, 1)
                    else:
                        local_rank, local_world = _mpi_node_ranks(size_var)
                    launcher = "mpi"
                    break
        step = slurm_step(environ) if launcher == "none" else None
        if step is not None:
            world, rank, local_rank, local_world = step.world_size, step.rank, step.local_rank, step.local_world_size
            launcher = "slurm"
        port = step.master_port if step is not None else _int(environ, "MASTER_PORT", 0)
        address = step.master_addr if step is not None else environ.get("MASTER_ADDR")
        if launcher == "mpi" and world > 1 and (address is None or not port):
            address, port = _mpi_rendezvous(single_node=local_world == world)
        device_type, device_index = _pick_device(local_rank, visible_devices, cuda_available)
        return cls(
            world_size=world,
            rank=rank,
            local_rank=local_rank,
            local_world_size=local_world,
            master_addr=address,
            master_port=port or None,
            launcher=launcher,
            device_type=device_type,
            device_index=device_index,
        )

    @classmethod
    def virtual(cls, world_size: int, gpu_per_worker: int | None = None) -> Cluster:
        """A cluster of ``world_size`` devices seen from rank 0, for planning without running."""
        if gpu_per_worker is not None and world_size % gpu_per_worker:
            raise ClusterError(
                f"A world of {world_size} devices cannot have {gpu_per_worker} devices on every worker "
                f"(--world-size must be a multiple of --gpu-per-worker)."
            )
        return cls(
            world_size=world_size,
            local_world_size=gpu_per_worker or world_size,
            launcher="plan",
        )


def _mpi_node_ranks(size_var: str) -> tuple[int, int]:
    """(local rank, local size) from mpi4py, for MPI launchers that do not export them."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise ClusterError(
            f"The MPI launcher set {size_var} but not this process's rank within its node, and mpi4py "
            "is not installed to ask MPI. Install it: pip install mpi4py mpich (or launch with epl launch)."
        ) from None
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


def _mpi_rendezvous(*, single_node: bool) -> tuple[str, int]:
    """Rank 0's address and a free port on it, broadcast over MPI (for jobs started by plain mpiexec)."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise ClusterError(
            "Started by an MPI launcher without MASTER_ADDR/MASTER_PORT, and mpi4py is not installed to share "
            "them. Install it (pip install mpi4py mpich), set both variables, or use `epl launch --mpi`."
        ) from None
    comm = MPI.COMM_WORLD
    chosen: tuple[str, int] | None = None
    if comm.Get_rank() == 0:
        host = "127.0.0.1" if single_node else socket.gethostbyname(socket.gethostname())
        chosen = (host, free_port(host))
    address, port = comm.bcast(chosen, root=0)
    return str(address), int(port)


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    text = environ.get(name)
    if text is None or text == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise ClusterError(f"Environment variable {name}={text!r} must be an integer.") from None


def _pick_device(local_rank: int, visible_devices: str, cuda_available: bool | None) -> tuple[str, int | None]:
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if not cuda_available:
        return "cpu", None
    if visible_devices:
        try:
            listed = [int(d) for d in visible_devices.split(",") if d.strip()]
        except ValueError:
            raise ClusterError(
                f"cluster.run_visible_devices={visible_devices!r} must be comma-separated device numbers, e.g. '0,1'."
            ) from None
        if local_rank >= len(listed):
            raise ClusterError(
                f"cluster.run_visible_devices={visible_devices!r} lists {len(listed)} devices, "
                f"but this process has local rank {local_rank}."
            )
        return "cuda", listed[local_rank]
    count = torch.cuda.device_count()
    if local_rank >= count:  # NCCL refuses two processes on one GPU ("invalid usage"): say so before it does
        raise ClusterError(
            f"This process has local rank {local_rank}, but the machine shows {count} GPU(s): NCCL needs one GPU "
            f"per process. Start at most {count} process(es) per machine (--nproc-per-node {count}), or hide the "
            "GPUs (CUDA_VISIBLE_DEVICES=) to run every process on the CPU with gloo."
        )
    return "cuda", local_rank
