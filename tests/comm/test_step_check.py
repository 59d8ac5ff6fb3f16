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


def skips_a_batch(sampler_only_on_rank_0: bool) -> dict[str, object]:
    """Rank 1 skips engine.step for its third batch of an epl.io loader; the check names it at that step.

    With ``sampler_only_on_rank_0``, rank 0 also walks a validation loader of its own between steps (as
    DDP scripts validate on rank 0): a sampler that only some ranks use never raises.
    """
    import torch
    from torch import nn

    import epl

    env = epl.init()
    torch.manual_seed(0)
    engine = epl.parallelize(nn.Linear(4, 2), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.MSELoss())
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 2))
    loader = epl.io.data_loader(data, 4, engine)
    checking = epl.io.data_loader(data, 8, engine, shuffle=False) if env.cluster.rank == 0 else None
    steps = 0
    for index, (x, y) in enumerate(loader):
        if sampler_only_on_rank_0 and checking is not None:
            _ = [batch for batch in checking]
        if index == 2 and env.cluster.rank == 1 and not sampler_only_on_rank_0:
            continue
        try:
            engine.step(x, y)
        except epl.EplError as error:
            return {"error": str(error), "steps": steps, "params": None}
        steps += 1
    return {"error": None, "steps": steps, "params": [p.detach().clone() for p in engine.model.parameters()]}


@pytest.mark.timeout(90)
def test_a_rank_that_skips_a_batch_is_named_at_that_step() -> None:
    first, second = run_ranks(skips_a_batch, 2, False, timeout=80)
    for result in (first, second):
        assert result["steps"] == 2, result  # steps 1 and 2 applied, step 3 refused on both ranks
        assert "are at step 3 on different data: rank 0 has drawn 12 samples of pass 1, rank 1 has drawn 16" in str(
            result["error"]
        )


@pytest.mark.timeout(90)
def test_a_sampler_only_some_ranks_use_is_not_compared() -> None:
    first, second = run_ranks(skips_a_batch, 2, True, timeout=80)
    assert first["error"] is None and second["error"] is None and first["steps"] == second["steps"] == 8
    for a, b in zip(first["params"], second["params"], strict=True):  # type: ignore[arg-type]
        assert a.equal(b)
