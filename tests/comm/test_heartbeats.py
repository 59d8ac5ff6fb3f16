"""Communicators made for one ``epl.init`` stop their heartbeat threads at the next one."""

from __future__ import annotations

import threading

import pytest

from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.multiprocess


def heartbeats_after_each_init(cycles: int) -> list[int]:
    import torch
    from torch import nn

    import epl

    counts = []
    for _ in range(cycles):
        epl.init(epl.Config({"communication.num_communicators": 2}))
        with epl.replicate(device_count=1):
            model = nn.Linear(4, 4)
        engine = epl.parallelize(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.MSELoss())
        engine.step(torch.randn(4, 4), torch.randn(4, 4))
        counts.append(sum(t.name.startswith("epl-heartbeat") for t in threading.enumerate()))
    return counts


def test_heartbeat_threads_do_not_pile_up_over_inits() -> None:
    for counts in run_ranks(heartbeats_after_each_init, 2, 3, timeout=120):
        assert counts[0] >= 2 and counts == [counts[0]] * 3, counts
