"""Gradients on a communicator of their own: what CUDA pipelines do (NCCL), checked on the CPU.

NCCL runs the messages between two ranks on one stream in the order they are posted, so EPL
sends the gradients going back between stages on a second communicator over the same ranks
(``epl_pipeline.topology.gradients_apart``; gloo keeps one). No GPU is needed to check that the
two communicators carry every message to the right place: each rank here takes the CUDA choice
on the CPU, and the runs of the plain pipeline tests must still equal one process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.helpers.distributed import run_ranks
from tests.helpers.reference import assert_rank_matches
from tests.pipeline import test_interleaved, test_mixed_stages, test_pipeline

pytestmark = pytest.mark.multiprocess


def with_gradients_apart(train: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """One rank: ``train(*args)`` with gradients on their own communicator; how often the pipeline asked."""
    import epl_pipeline.topology as topology

    asked: list[str] = []

    def apart(device: Any) -> bool:
        asked.append(str(device))
        return True

    topology.gradients_apart = apart
    return {**train(*args), "asked": asked}


def test_the_cpu_keeps_one_communicator_and_cuda_takes_two() -> None:
    import torch

    from epl_pipeline.topology import gradients_apart

    assert not gradients_apart(torch.device("cpu"))
    assert gradients_apart(torch.device("cuda", 0))


@pytest.mark.parametrize("strategy", ["PreferBackward", "ZeroBubble"])
def test_two_stages_equal_the_local_run(strategy: str) -> None:
    import torch

    ranks = run_ranks(with_gradients_apart, 2, test_pipeline.train, strategy, timeout=180)
    assert all(r["asked"] == ["cpu"] for r in ranks)
    losses, state = test_pipeline.reference(1)
    for rank, result in enumerate(ranks):
        torch.testing.assert_close(result["losses"], losses, rtol=1e-12, atol=1e-12)
        for name, value in result["state"].items():
            torch.testing.assert_close(value, state[name], rtol=1e-12, atol=1e-12, msg=f"rank {rank} {name}")


def test_interleaved_stages_equal_the_local_run() -> None:
    ranks = run_ranks(with_gradients_apart, 2, test_interleaved.train, {}, timeout=180)
    assert all(r["asked"] == ["cpu"] for r in ranks)
    losses, full, _ = test_interleaved.reference(1)
    for result in ranks:
        assert_rank_matches(result, losses, full, test_interleaved.TOLERANCE)


@pytest.mark.timeout(150)
def test_stages_that_reshard_equal_the_local_run() -> None:
    """split(2) then replicate(2): each device's rows come from both devices of the first stage, and their
    gradients go back to both."""
    stages = (("split", 2), ("replicate", 2))
    results = run_ranks(with_gradients_apart, 4, test_mixed_stages.train, stages, {}, timeout=140)
    assert all(r["asked"] == ["cpu"] for r in results)
    held = {0: test_mixed_stages.SPLIT_2[0], 1: test_mixed_stages.WHOLE[1]}
    test_mixed_stages.assert_equal_to_local(results, stages, held)
