"""Joining the job's processes through torch.distributed's rendezvous (MASTER_ADDR/MASTER_PORT).

Rank 0 hosts the rendezvous store. torch's own ``env://`` store listens on every interface;
EPL's listens on MASTER_ADDR only (loopback on one machine, by default), through a socket it
binds itself and hands to ``TCPStore``. The store has no authentication: on several machines
MASTER_ADDR must be an address inside a trusted network. Under torchrun, whose agent already
runs a store, ``env://`` reuses it.
"""

from __future__ import annotations

import atexit
import datetime
import errno
import os
import socket
import sys

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
        wait = datetime.timedelta(seconds=timeout)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's agent hosts the store
            dist.init_process_group(
                backend, init_method="env://", rank=cluster.rank, world_size=cluster.world_size, timeout=wait
            )
        else:
            store = _store(cluster.master_addr, cluster.master_port, cluster.rank, cluster.world_size, wait)
            dist.init_process_group(
                backend, store=store, rank=cluster.rank, world_size=cluster.world_size, timeout=wait
            )
        atexit.register(_destroy_process_group)
    if dist.get_world_size() != cluster.world_size:
        raise ClusterError(
            f"The existing process group has {dist.get_world_size()} processes, the environment says "
            f"{cluster.world_size}."
        )


def _store(address: str, port: int, rank: int, world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The rendezvous store: rank 0 listens on ``address`` only (not every interface), the others connect."""
    if rank != 0:
        return dist.TCPStore(address, port, world_size, False, timeout)
    listener = _listen(address, port)
    if listener is None:  # the address is not this machine's own (e.g. behind NAT): torch listens everywhere
        return dist.TCPStore(address, port, world_size, True, timeout)
    return dist.TCPStore(address, port, world_size, True, timeout, master_listen_fd=listener.detach())


def _listen(address: str, port: int) -> socket.socket | None:
    """A socket listening on ``address``:``port``, or None when ``address`` is not one of this machine's."""
    try:
        family, kind, proto, _, where = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as error:
        raise ClusterError(f"MASTER_ADDR {address!r} does not resolve ({error}); give rank 0's address.") from None
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(where)
        listener.listen(max(128, socket.SOMAXCONN))
    except OSError as error:
        listener.close()
        if error.errno == errno.EADDRNOTAVAIL:
            return None
        raise ClusterError(f"Rank 0 cannot listen on MASTER_ADDR {address}:{port}: {error}.") from None
    return listener


def default_store() -> dist.Store | None:
    """The job's key-value store (for diagnostics), or None if torch does not expose it."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - diagnostics work without it, just with less to say
        return None


#: How long a process that ends cleanly waits for the others at exit before it closes anyway.
LEAVE_TOGETHER_TIMEOUT_S = 5.0


def _destroy_process_group() -> None:
    stop_all_heartbeats()
    if dist.is_initialized():
        if getattr(sys, "last_value", None) is None:  # no uncaught exception: the others are ending too
            _leave_together()
        dist.destroy_process_group()


def _leave_together() -> None:
    """Wait (briefly, on the store, not on gloo) until every rank is ending, so that all close together.

    gloo's I/O thread can abort a process (SIGABRT) whose idle connection a peer closes by exiting
    first. Ranks that meet here close within moments of each other. The meeting goes through the
    rendezvous store, so it never leaves a collective pending, and a rank whose peers are stuck
    (one of them failed) waits ``LEAVE_TOGETHER_TIMEOUT_S`` at most.
    """
    store, world_size = default_store(), dist.get_world_size()
    if store is None or world_size == 1 or "gloo" not in str(dist.get_backend()):
        return
    key = f"epl/leaving/{os.environ.get('EPL_RESTART_COUNT', os.environ.get('TORCHELASTIC_RESTART_COUNT', '0'))}"
    try:
        if store.add(key, 1) == world_size:
            store.set(f"{key}/all", "1")
        store.wait([f"{key}/all"], datetime.timedelta(seconds=LEAVE_TOGETHER_TIMEOUT_S))
    except Exception:  # noqa: BLE001 - a late peer, or rank 0's store already gone: close regardless
        pass
