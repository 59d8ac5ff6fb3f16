"""Reading the cluster from the variables of torchrun, epl launch and MPI launchers."""

from __future__ import annotations

import pytest
import torch

import epl
from epl.interfaces.cluster import Cluster


def test_no_launcher_is_one_local_process() -> None:
    cluster = Cluster.from_environ({}, cuda_available=False)
    assert (cluster.world_size, cluster.rank, cluster.local_rank, cluster.launcher) == (1, 0, 0, "none")
    assert cluster.total_gpu_num == 1 and cluster.device == torch.device("cpu")


def test_torchrun_variables() -> None:
    env = {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
    }
    cluster = Cluster.from_environ(env, cuda_available=False)
    assert (cluster.rank, cluster.world_size, cluster.local_rank, cluster.gpu_per_worker) == (5, 8, 1, 4)
    assert (cluster.num_workers, cluster.worker_index, cluster.total_gpu_num) == (2, 1, 8)
    assert (cluster.master_addr, cluster.master_port, cluster.launcher) == ("10.0.0.1", 29500, "torchrun")


@pytest.mark.parametrize(
    "env",
    [
        {
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_RANK": "3",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        },
        {"PMI_SIZE": "4", "PMI_RANK": "3", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
        {"PMIX_SIZE": "4", "PMIX_RANK": "3", "PMIX_LOCAL_RANK": "1", "PMIX_LOCAL_SIZE": "2"},
    ],
    ids=["openmpi", "mpich", "pmix"],
)
def test_mpi_variables(env: dict[str, str]) -> None:
    cluster = Cluster.from_environ(env, cuda_available=False)
    assert (cluster.world_size, cluster.rank, cluster.local_rank, cluster.num_workers, cluster.launcher) == (
        4,
        3,
        1,
        2,
        "mpi",
    )


def test_cuda_device_follows_local_rank_and_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    env = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4"}
    assert Cluster.from_environ(env, cuda_available=True).device == torch.device("cuda", 2)
    assert Cluster.from_environ(env, cuda_available=True, visible_devices="3,1,0,2").device == torch.device("cuda", 0)
    with pytest.raises(epl.ClusterError, match="lists 2 devices, but this process has local rank 2"):
        Cluster.from_environ(env, cuda_available=True, visible_devices="0,1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(epl.ClusterError, match=r"local rank 2, but the machine shows 2 GPU\(s\).*--nproc-per-node 2"):
        Cluster.from_environ(env, cuda_available=True)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "4", "WORLD_SIZE": "4"}, r"RANK 4 is outside the world of 4 processes"),
        (
            {"RANK": "0", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"},
            r"WORLD_SIZE 6 is not a multiple of LOCAL_WORLD_SIZE 4",
        ),
        ({"RANK": "x", "WORLD_SIZE": "2"}, r"RANK='x' must be an integer"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, r"WORLD_SIZE must be at least 1"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "abc"}, r"MASTER_PORT='abc' must be an integer"),
    ],
)
def test_inconsistent_environment_is_an_error(env: dict[str, str], message: str) -> None:
    with pytest.raises(epl.ClusterError, match=message):
        Cluster.from_environ(env, cuda_available=False)


def test_virtual_cluster_for_planning() -> None:
    cluster = Cluster.virtual(1024, 8)
    assert (cluster.total_gpu_num, cluster.num_workers, cluster.rank, cluster.launcher) == (1024, 128, 0, "plan")


def test_env_exposes_cluster_config_and_plugins() -> None:
    env = epl.init()
    assert epl.Env.get() is env
    assert env.cluster.total_gpu_num == 1 and env.config["pipeline.num_micro_batch"] == 1
    assert env.plugins.has_plugin("epl-core") and env.communicator is not None and not env.planning


def test_local_rank_defaults_to_rank_within_the_node() -> None:
    cluster = Cluster.from_environ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, cuda_available=False)
    assert (cluster.local_rank, cluster.worker_index) == (1, 1)


def test_visible_devices_must_be_numbers() -> None:
    with pytest.raises(epl.ClusterError, match="must be comma-separated device numbers"):
        Cluster.from_environ({}, cuda_available=True, visible_devices="a,b")


def test_virtual_cluster_names_the_options() -> None:
    with pytest.raises(epl.ClusterError, match="--world-size must be a multiple of --gpu-per-worker"):
        Cluster.virtual(8, 3)
