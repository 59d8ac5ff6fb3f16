"""``epl.init`` after ``epl.init`` releases what the previous one made: threads, files and sockets stay flat."""

from __future__ import annotations

import os
from contextlib import nullcontext

import pytest

from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.multiprocess

CYCLES = 100


def cycles() -> list[tuple[int, int]]:
    """On each rank: ``CYCLES`` rounds of init, parallelize (data parallel, or a 2-stage pipeline) and a step;
    threads and open files after each."""
    import torch
    from torch import nn

    import epl

    counts = []
    for cycle in range(CYCLES):
        pipelined = cycle % 2 == 1  # every other cycle a 2-stage pipeline (its links and groups)
        epl.init(epl.Config({"pipeline.num_micro_batch": 2} if pipelined else {}))
        with epl.replicate(1, name="stage_0") if pipelined else nullcontext():
            first = nn.Linear(4, 4)
        with epl.replicate(1, name="stage_1") if pipelined else nullcontext():
            second = nn.Linear(4, 4)
        model = nn.Sequential(first, second)
        engine = epl.parallelize(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.MSELoss())
        torch.manual_seed(cycle)  # the ranks of a pipeline replica are given the same batch
        engine.step(torch.randn(8, 4), torch.randn(8, 4))
        counts.append((len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))))
    old = engine
    epl.init()
    try:
        old.step(torch.randn(8, 4), torch.randn(8, 4))
    except epl.EplError as error:
        counts.append((-1, len(str(error))) if "closed when epl.init started over" in str(error) else (-2, 0))
    return counts


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="counts threads and files in Linux's /proc")
@pytest.mark.timeout(240)
def test_a_hundred_re_inits_leave_threads_and_open_files_flat() -> None:
    for counts in run_ranks(cycles, 2, timeout=220):
        *steady, used_after_close = counts
        # the same after cycles 3 and 4 as after cycles 99 and 100
        assert steady[-2:] == steady[2:4], steady[:4] + steady[-4:]
        assert used_after_close[0] == -1  # an engine of an earlier init is one clear error
