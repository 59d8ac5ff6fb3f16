"""Real multi-process runs through the shared helper: gloo works, EPL reads each rank, failures are readable."""

from __future__ import annotations

import time

import pytest

from tests.helpers.distributed import DistributedTestError, init_gloo, run_ranks

pytestmark = pytest.mark.multiprocess


def all_reduce_and_read_cluster(value: float) -> tuple[int, int, float, int]:
    import torch
    import torch.distributed as dist

    from epl.interfaces.cluster import Cluster

    init_gloo(timeout_seconds=30)
    cluster = Cluster.from_environ()
    tensor = torch.tensor([value * (cluster.rank + 1)])
    dist.all_reduce(tensor)
    return cluster.rank, cluster.world_size, float(tensor.item()), cluster.total_gpu_num


def test_gloo_all_reduce_and_cluster_on_real_processes() -> None:
    results = run_ranks(all_reduce_and_read_cluster, 2, 1.5, timeout=90)
    assert results == [(0, 2, 4.5, 2), (1, 2, 4.5, 2)]


def init_without_epl_comm() -> str:
    import epl

    try:
        epl.init()
    except epl.MissingPluginError as exc:
        return str(exc)
    return "no error"


def test_epl_init_on_several_processes_without_epl_comm_names_the_package() -> None:
    messages = run_ranks(init_without_epl_comm, 2, timeout=90, env={"EPL_DISABLE_EXTERNAL_PLUGINS": "1"})
    for message in messages:
        assert "can join 2 processes" in message and "pip install epl-comm" in message


def fail_on_rank_one() -> None:
    import torch.distributed as dist

    init_gloo(timeout_seconds=30)
    print("rank says hello", flush=True)
    if dist.get_rank() == 1:
        raise ValueError("rank 1 broke on purpose")
    dist.barrier()  # rank 0 waits here until it is stopped


def test_a_failing_rank_is_reported_with_its_traceback_and_log() -> None:
    started = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_ranks(fail_on_rank_one, 2, timeout=90)
    report = str(info.value)
    assert "failed, rank 1 first" in report
    assert "ValueError: rank 1 broke on purpose" in report
    assert "--- rank 0:" in report and "rank says hello" in report
    assert time.monotonic() - started < 60, "the healthy rank was not stopped promptly"


def sleep_forever() -> None:
    time.sleep(600)


def test_ranks_that_hang_time_out() -> None:
    with pytest.raises(DistributedTestError, match=r"did not finish within 5s; still running: ranks \[0, 1\]"):
        run_ranks(sleep_forever, 2, timeout=5)
