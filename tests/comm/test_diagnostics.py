"""A collective that a rank skips fails on the others within the timeout, naming the missing rank."""

from __future__ import annotations

import time

import pytest

from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.multiprocess

TIMEOUT = 3


def skip_the_second_collective() -> tuple[str, float]:
    import torch

    import epl
    from epl_comm import CollectiveTimeoutError

    env = epl.init(epl.Config({"communication.timeout": TIMEOUT}))
    comm = env.communicator
    tensor = torch.ones(1024)
    comm.all_reduce(tensor).wait()  # collective #1: everyone
    if comm.rank == 1:
        time.sleep(TIMEOUT + 3)  # skips collective #2 but stays alive
        return "skipped", 0.0
    started = time.monotonic()
    try:
        comm.all_reduce(tensor).wait()
    except CollectiveTimeoutError as exc:
        return str(exc), time.monotonic() - started
    return "completed", time.monotonic() - started


def test_skipped_collective_names_the_rank_that_did_not_arrive() -> None:
    results = run_ranks(skip_the_second_collective, 3, timeout=120)
    assert results[1] == ("skipped", 0.0)
    for rank in (0, 2):
        message, waited = results[rank]
        assert "all_reduce #2 (1,024 x torch.float32)" in message, message
        assert "ranks [1] did not arrive: rank 1 is at #1 (all_reduce)" in message, message
        assert f"within {TIMEOUT}s on rank {rank}" in message
        assert waited < TIMEOUT + 2


def skip_in_a_split_group() -> str:
    import torch

    import epl
    from epl_comm import CollectiveTimeoutError

    env = epl.init(epl.Config({"communication.timeout": TIMEOUT}))
    world = env.communicator
    group = world.split([[0], [1, 2]])
    tensor = torch.ones(8)
    if world.rank == 0:
        group.all_reduce(tensor).wait()  # alone in its group
    if world.rank == 2:
        time.sleep(TIMEOUT + 3)  # skips the group's first collective
        return "skipped"
    if world.rank == 0:
        time.sleep(TIMEOUT + 3)  # keep the job's store (hosted by rank 0) up for the others' diagnosis
        return "completed"
    try:
        group.all_reduce(tensor).wait()
    except CollectiveTimeoutError as exc:
        return str(exc)
    return "completed"


def test_split_groups_report_global_ranks() -> None:
    results = run_ranks(skip_in_a_split_group, 3, timeout=120)
    assert results[0] == "completed" and results[2] == "skipped"
    assert "(ranks [1, 2])" in results[1] and "on rank 1: ranks [2] did not arrive" in results[1], results[1]


def test_timeout_error_without_store_still_names_the_operation() -> None:
    import torch

    from epl_comm.diagnostics import CollectiveLog

    log = CollectiveLog("solo", rank=0, ranks=(0, 1), store=None)
    record = log.start("broadcast", torch.zeros(3))
    assert "broadcast #1 (3 x torch.float32)" in str(log.timeout_error(record, 5))
    assert log.bytes_sent == 12
