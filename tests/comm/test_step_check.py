"""Ranks averaging gradients are at the same step: a mismatch, or a rank that took fewer steps, names the steps."""

from __future__ import annotations

import pytest

from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.multiprocess


def counts_differ() -> str:
    """Rank 1's step counter is one ahead (as after a step retried on that rank alone)."""
    import epl
    from epl_comm.step_check import StepCheck, StepMismatchError

    env = epl.init()
    assert env.communicator is not None
    check = StepCheck(env.communicator)
    if env.cluster.rank == 1:
        check.step = 1
    check.start()
    try:
        check.finish()
    except StepMismatchError as error:
        return str(error)
    return "no error"


@pytest.mark.timeout(60)
def test_different_step_counts_are_an_error_on_every_rank_naming_each_step() -> None:
    for message in run_ranks(counts_differ, 2, timeout=50):
        assert "at different steps: rank 0 at step 1, rank 1 at step 2" in message


def one_step_fewer() -> str:
    """Rank 1 skips the third step of five, then ends its loop; rank 0 takes a fifth step alone."""
    import torch
    from torch import nn

    import epl

    env = epl.init()
    engine = epl.parallelize(nn.Linear(4, 4), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.MSELoss())
    for step in range(5):
        if step == 2 and env.cluster.rank == 1:
            continue
        try:
            engine.step(torch.randn(8, 4), torch.randn(8, 4))
        except epl.EplError as error:
            return str(error)
    return "finished"


@pytest.mark.timeout(60)
def test_a_rank_that_took_fewer_steps_is_named_when_it_ends() -> None:
    first, second = run_ranks(one_step_fewer, 2, timeout=50)
    assert second == "finished"
    assert first.startswith("all_gather #") and "rank 1 went away" in first
    assert "the ranks took different numbers of steps (this rank is at step 5)" in first
