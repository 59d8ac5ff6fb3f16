"""What a Slurm job step tells its tasks: ranks, node count, rank 0's host, a port (``srun python train.py``).

Slurm's variables (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, the tasks per node and
the node list) are read as torchrun's are. Rank 0's address is the first host of the step's
node list (``node[01-04]`` is expanded as far as its first host); the port is ``MASTER_PORT``,
else one derived from the job id (15000 + its last four digits, as PyTorch Lightning does), so
every task of the job computes the same one without talking to the others.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from epl.errors import ClusterError


@dataclass(frozen=True)
class SlurmStep:
    """This task's place in a Slurm job step."""

    world_size: int
    rank: int
    local_rank: int
    local_world_size: int
    num_nodes: int
    node_rank: int
    master_addr: str
    master_port: int


def slurm_step(environ: Mapping[str, str]) -> SlurmStep | None:
    """The job step's shape when this process is a task of ``srun`` (``SLURM_PROCID`` and the step's
    ``SLURM_STEP_NUM_TASKS`` set), else None: a batch script itself has a ``SLURM_PROCID`` too, and must stay one
    process rather than wait for tasks that do not exist."""
    if "SLURM_PROCID" not in environ or "SLURM_STEP_NUM_TASKS" not in environ:
        return None  # not a task of srun: a batch script or a shell of the allocation is one process
    world = _int(environ, "SLURM_STEP_NUM_TASKS")
    per_node = tasks_per_node(environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE") or "")
    nodes = (
        _int(environ, "SLURM_STEP_NUM_NODES") if "SLURM_STEP_NUM_NODES" in environ else _int(environ, "SLURM_NNODES", 1)
    )
    local_world = per_node if per_node is not None else world // max(nodes, 1)
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        raise ClusterError("Slurm set SLURM_PROCID but no node list (SLURM_JOB_NODELIST): cannot find rank 0's host.")
    port = _int(environ, "MASTER_PORT", 0) or 15000 + _int(environ, "SLURM_JOB_ID", 0) % 10000
    return SlurmStep(
        world_size=world,
        rank=_int(environ, "SLURM_PROCID"),
        local_rank=_int(environ, "SLURM_LOCALID", 0),
        local_world_size=local_world,
        num_nodes=nodes,
        node_rank=_int(environ, "SLURM_NODEID", 0),
        master_addr=environ.get("MASTER_ADDR") or first_host(nodelist),
        master_port=port,
    )


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: ``gpu[003-010,12],cpu1`` -> ``gpu003``."""
    head = re.match(r"([^,\[]*)(\[([^\]]*)\])?", nodelist.strip())
    assert head is not None  # the pattern matches any text
    prefix, ranges = head.group(1), head.group(3)
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def tasks_per_node(value: str) -> int | None:
    """The tasks on each node from ``SLURM_TASKS_PER_NODE`` (``4(x2)``, ``4,4``), or None when the nodes differ or
    it is absent (EPL needs as many processes on every node)."""
    counts = set()
    for part in filter(None, value.split(",")):
        match = re.fullmatch(r"(\d+)(\(x\d+\))?", part.strip())
        if match is None:
            return None
        counts.add(int(match.group(1)))
    if len(counts) > 1:
        raise ClusterError(
            f"Slurm runs different numbers of tasks on the nodes (SLURM_TASKS_PER_NODE={value}): EPL needs as many "
            "on every node. Ask srun for --ntasks-per-node."
        )
    return counts.pop() if counts else None


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = environ.get(name)
    if value is None:
        if default is None:
            raise ClusterError(f"Slurm did not set {name}.")
        return default
    try:
        return int(value)
    except ValueError:
        raise ClusterError(f"{name}={value!r} is not a whole number.") from None
