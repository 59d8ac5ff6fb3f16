"""On one machine with default flags, nothing of the job listens beyond loopback."""

from __future__ import annotations

import os

import pytest

from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.multiprocess

#: /proc/net/tcp{,6} local addresses of loopback: 127.0.0.1 and ::1.
LOOPBACK = ("0100007F:", "00000000000000000000000001000000:")


def listening_addresses() -> list[str]:
    """The local addresses of this process's listening TCP sockets (as /proc/net writes them), after epl.init."""
    import torch.distributed as dist

    import epl

    epl.init()
    dist.barrier()
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in open(f"/proc/net/{table}").read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(fields[1])
    dist.barrier()
    return found


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net")
@pytest.mark.timeout(60)
def test_a_default_two_rank_job_listens_on_loopback_only() -> None:
    rank_0, rank_1 = run_ranks(listening_addresses, 2, timeout=50)
    assert len(rank_0) >= 2  # the rendezvous store and gloo's connections
    assert all(address.startswith(LOOPBACK) for address in [*rank_0, *rank_1]), (rank_0, rank_1)
