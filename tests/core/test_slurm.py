"""`srun python train.py`: a Slurm task's rank, world, local rank and rank 0's address, read from Slurm's variables."""

from __future__ import annotations

import pytest

import epl
from epl.interfaces.cluster import Cluster
from epl.interfaces.slurm import first_host, tasks_per_node

#: What srun sets for task 5 of `srun -N 2 --ntasks-per-node 4 python train.py` (job 123456).
SRUN_TASK_5 = {
    "SLURM_JOB_ID": "123456",
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NNODES": "2",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    "SLURM_JOB_NODELIST": "gpu[007-008]",
    "SLURM_STEP_NODELIST": "gpu[007-008]",
}


def test_a_srun_task_reads_its_place_from_slurm() -> None:
    cluster = Cluster.from_environ(SRUN_TASK_5)
    assert (cluster.world_size, cluster.rank, cluster.local_rank, cluster.local_world_size) == (8, 5, 1, 4)
    assert (cluster.num_workers, cluster.worker_index, cluster.launcher) == (2, 1, "slurm")
    assert cluster.master_addr == "gpu007" and cluster.master_port == 15000 + 3456


def test_torchrun_variables_and_master_port_win() -> None:
    cluster = Cluster.from_environ({**SRUN_TASK_5, "MASTER_PORT": "29400", "MASTER_ADDR": "10.0.0.1"})
    assert (cluster.master_addr, cluster.master_port) == ("10.0.0.1", 29400)
    under_torchrun = Cluster.from_environ({**SRUN_TASK_5, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    assert (under_torchrun.world_size, under_torchrun.launcher) == (2, "torchrun")


def test_an_allocation_without_srun_is_one_local_process() -> None:
    """A batch script (SLURM_PROCID 0 of the job's tasks, but no step of srun) or a shell of salloc is one process."""
    batch_script = {key: value for key, value in SRUN_TASK_5.items() if not key.startswith("SLURM_STEP_")}
    assert Cluster.from_environ({**batch_script, "SLURM_PROCID": "0"}).world_size == 1


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [("gpu[007-008]", "gpu007"), ("node1,node2", "node1"), ("a[3,5-6],b[1-2]", "a3"), ("solo", "solo")],
)
def test_the_first_host_of_a_node_list(nodelist: str, first: str) -> None:
    assert first_host(nodelist) == first


def test_tasks_per_node_must_be_equal() -> None:
    assert tasks_per_node("4(x2)") == 4 and tasks_per_node("2,2") == 2 and tasks_per_node("") is None
    with pytest.raises(epl.ClusterError, match="different numbers of tasks"):
        tasks_per_node("4,3")
