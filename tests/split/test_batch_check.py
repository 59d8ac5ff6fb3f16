"""The ranks of one replica must be given the same batch: a mismatch is an error naming them, at that step.

A script ported from DDP keys its sampler by the global rank; under ``epl.split`` (and pipeline
stages) every rank of a replica would then compute a part of a mixture of batches and train on
with no error. ``Engine.step`` compares a fingerprint of the batch over the replica first
(:mod:`epl.runtime.batch_check`); ``io.check_batches=False`` switches it off.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.multiprocess


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def keyed_by_global_rank(config: dict[str, Any], stages: int) -> dict[str, Any]:
    """Each rank draws its own batch from a generator seeded by its global rank, as a DDP sampler would."""
    import torch.distributed as dist

    import epl

    epl.init(epl.Config(config))
    if stages == 1:
        with epl.split(2):
            net = model()
    else:
        with epl.replicate(1, name="stage_0"):
            first = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        with epl.replicate(1, name="stage_1"):
            second = nn.Linear(16, 4)
        net = nn.Sequential(first, second)
    engine = epl.parallelize(net, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.MSELoss())
    same = torch.Generator().manual_seed(7)
    own = torch.Generator().manual_seed(100 + dist.get_rank())
    losses = [float(engine.step(torch.randn(4, 8, generator=same), torch.randn(4, 4, generator=same)))]
    try:
        losses.append(float(engine.step(torch.randn(4, 8, generator=own), torch.randn(4, 4, generator=own))))
    except epl.EplError as error:
        return {"error": str(error), "type": type(error).__name__, "losses": losses}
    return {"error": None, "losses": losses}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stages", [1, 2], ids=["split", "pipeline"])
def test_ranks_of_a_replica_given_different_batches_fail_naming_them(stages: int) -> None:
    config = {"pipeline.num_micro_batch": 2} if stages == 2 else {}
    for result in run_ranks(keyed_by_global_rank, 2, config, stages, timeout=100):
        assert result["type"] == "BatchMismatchError"
        assert "ranks of replica 0 (ranks [0, 1]) were given different batches at step 2" in result["error"]
        assert "ranks [1] differ from rank 0" in result["error"]
        assert "epl.io.data_loader" in result["error"] and "io.check_batches=False" in result["error"]
        assert len(result["losses"]) == 1  # the first step, on equal batches, ran


@pytest.mark.timeout(120)
def test_the_check_switched_off_lets_the_step_run() -> None:
    for result in run_ranks(keyed_by_global_rank, 2, {"io.check_batches": False}, 1, timeout=100):
        assert result["error"] is None and len(result["losses"]) == 2


def test_fingerprints_of_equal_batches_are_equal_and_of_different_ones_differ() -> None:
    from epl.runtime.batch_check import fingerprint

    ids = torch.randint(0, 1000, (8, 512))
    assert torch.equal(fingerprint({"input_ids": ids}), fingerprint({"input_ids": ids.clone()}))
    shuffled = ids[torch.randperm(8)]
    assert not torch.equal(fingerprint({"input_ids": ids}), fingerprint({"input_ids": shuffled}))
    assert not torch.equal(fingerprint((ids, None)), fingerprint((ids[:, :256], None)))  # shapes count
    assert not torch.equal(fingerprint((ids, ids)), fingerprint((ids,)))  # so does the number of tensors
