"""Joining the job's processes through torch.distributed's rendezvous (MASTER_ADDR/MASTER_PORT)."""

from __future__ import annotations

import atexit
import datetime
import os

import torch.distributed as dist

from epl.plugin_api import Cluster, ClusterError
from epl_comm.diagnostics import stop_all_heartbeats


def join_process_group(cluster: Cluster, backend: str, *, timeout: float) -> None:
    """Make the default process group of ``cluster`` unless the script already made one.

    Uses ``env://`` (not ``tcp://``) so that under torchrun the agent's store is reused.
    The group lives until the process ends (a second ``epl.init`` reuses it).
    """
    if not dist.is_initialized():
        if cluster.master_addr is None or cluster.master_port is None:
            raise ClusterError(
                f"{cluster.world_size} processes need MASTER_ADDR and MASTER_PORT to meet; launch with "
                "`epl launch` or torchrun, or set them to rank 0's address and a free port."
            )
        os.environ.setdefault("MASTER_ADDR", cluster.master_addr)
        os.environ.setdefault("MASTER_PORT", str(cluster.master_port))
        dist.init_process_group(
            backend,
            init_method="env://",
            rank=cluster.rank,
            world_size=cluster.world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        atexit.register(_destroy_process_group)
    if dist.get_world_size() != cluster.world_size:
        raise ClusterError(
            f"The existing process group has {dist.get_world_size()} processes, the environment says "
            f"{cluster.world_size}."
        )


def default_store() -> dist.Store | None:
    """The job's key-value store (for diagnostics), or None if torch does not expose it."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - diagnostics work without it, just with less to say
        return None


def _destroy_process_group() -> None:
    stop_all_heartbeats()
    if dist.is_initialized():
        dist.destroy_process_group()
