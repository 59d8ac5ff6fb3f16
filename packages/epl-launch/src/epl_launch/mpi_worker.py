"""The program ``epl launch --mpi`` hands to mpiexec: it gives the target its rank, and labels its output.

mpiexec places and numbers the processes; each runs this module, which asks MPI
(mpi4py) for its rank, starts the target with the variables
``epl.init`` reads (RANK, WORLD_SIZE, ...), prefixes every line of its output with
``[rank N]`` and exits with its code; a failure calls MPI_Abort, so mpiexec ends
every other rank at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, TypedDict

from epl_launch.config import GROUPS_DIR_VARIABLE
from epl_launch.processes import signal_group

#: Variables of the MPI launcher that the target must not see (it is not an MPI process).
_MPI_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "MPI_LOCAL", "HYDRA_")


def main(argv: list[str]) -> int:
    """Run ``argv`` as this MPI process's rank; return its exit code (a failure aborts the whole job)."""
    from mpi4py import MPI

    from epl.plugin_api import Cluster

    cluster = Cluster(
        world_size=MPI.COMM_WORLD.Get_size(),
        rank=MPI.COMM_WORLD.Get_rank(),
        **_node_ranks(MPI),
        launcher="mpi",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(_MPI_PREFIXES) and k != GROUPS_DIR_VARIABLE}
    env.update(
        RANK=str(cluster.rank),
        WORLD_SIZE=str(cluster.world_size),
        LOCAL_RANK=str(cluster.local_rank),
        LOCAL_WORLD_SIZE=str(cluster.local_world_size),
        EPL_LAUNCHER="mpi",
    )
    child = subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # its own process group, ended with everything it started
    )
    groups = os.environ.get(GROUPS_DIR_VARIABLE)
    if groups:  # tell the launcher, which ends the group even if mpiexec kills this process first
        with open(os.path.join(groups, f"rank{cluster.rank}.pgid"), "w") as file:
            file.write(str(child.pid))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: signal_group(child.pid, signum))
    reader = threading.Thread(target=_copy_output, args=(child, cluster.rank), daemon=True)
    reader.start()
    code = child.wait()
    signal_group(child.pid, signal.SIGKILL)  # what the target left running would hold its output open
    reader.join(timeout=5)
    code = code if code >= 0 else 128 - code
    if code != 0:
        sys.stdout.flush()
        if groups:  # tell the launcher which rank failed first, and how
            with open(os.path.join(groups, f"rank{cluster.rank}.failed"), "w") as file:
                file.write(f"{time.time()} {code}")
        MPI.COMM_WORLD.Abort(code)  # mpiexec ends every other rank and exits with this code
    return code


class _NodeRanks(TypedDict):
    local_rank: int
    local_world_size: int


def _node_ranks(mpi: Any) -> _NodeRanks:
    node = mpi.COMM_WORLD.Split_type(mpi.COMM_TYPE_SHARED)
    try:
        return {"local_rank": node.Get_rank(), "local_world_size": node.Get_size()}
    finally:
        node.Free()


def _copy_output(child: subprocess.Popen[bytes], rank: int) -> None:
    prefix = f"[rank {rank}] ".encode()
    assert child.stdout is not None
    for line in iter(child.stdout.readline, b""):
        sys.stdout.buffer.write(prefix + line)
        sys.stdout.buffer.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
