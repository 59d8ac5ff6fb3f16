"""Data parallelism on real processes equals the local run on the same global batch."""

from __future__ import annotations

import pytest
import torch

from tests.comm.scenarios import OPTIMIZERS, check, train_on_ranks
from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.multiprocess

EQUIVALENCE = [
    {"optimizer": name, "dtype": dtype, "config": {"pipeline.num_micro_batch": micro}}
    for name in OPTIMIZERS
    for dtype in (torch.float32, torch.float64)
    for micro in (1, 2)
]


def test_two_processes_equal_the_local_run_for_sgd_adam_adamw_with_and_without_accumulation() -> None:
    ranks = run_ranks(train_on_ranks, 2, EQUIVALENCE, timeout=240)
    check(EQUIVALENCE, ranks)


FOUR = [
    {"optimizer": "adam", "dtype": torch.float64, "config": {"pipeline.num_micro_batch": 2}},
    {"optimizer": "sgd", "dtype": torch.float32},
    # replicate(2) on 4 processes: 2 replicas, each replica batch split 2 ways
    {"optimizer": "adamw", "dtype": torch.float64, "device_count": 2},
]


def test_four_processes_and_replicate_two_split_the_replica_batch() -> None:
    ranks = run_ranks(train_on_ranks, 4, FOUR, timeout=240)
    check(FOUR, ranks)
    replicate_two = [rank_results[2] for rank_results in ranks]
    assert [r["replica"] for r in replicate_two] == [0, 0, 1, 1]
    # both ranks of a replica return the replica's mean loss
    assert replicate_two[0]["losses"] == replicate_two[1]["losses"]


#: Four 512 x 512 layers: 4 MiB of float32 gradients, against a few KiB of activations (2 rows).
WIDTH, LAYERS, ROWS = 512, 4, 2


def step_peak(micro_batches: int) -> dict[str, int]:
    """This rank's steady peak allocation over a data-parallel step, and the bytes of the gradients."""
    import epl
    from epl_memory.measure import steady_peak_allocated_bytes

    torch.manual_seed(0)
    epl.init(epl.Config({"pipeline.num_micro_batch": micro_batches}))
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)))
    engine = epl.parallelize(
        model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=lambda out, target: (out - target).pow(2).mean()
    )
    x, y = torch.randn(ROWS * micro_batches, WIDTH), torch.randn(ROWS * micro_batches, WIDTH)
    engine.step(x, y)  # the buckets' buffers are made on the first step and kept
    return {
        "peak": steady_peak_allocated_bytes(lambda: engine.step(x, y)),
        "gradients": sum(p.numel() * p.element_size() for p in model.parameters()),
    }


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_gradients_are_held_once_during_backward(micro_batches: int) -> None:
    """Each gradient lands in its bucket's buffer as autograd makes it (DDP's gradient_as_bucket_view): a step holds
    the buffers and one layer's fresh gradient at a time, not a second copy of every gradient."""
    for rank in run_ranks(step_peak, 2, micro_batches, timeout=240):
        # the buffers exist before the step, so the peak above it is about one layer's gradient (1 MiB)
        assert rank["peak"] < 0.5 * rank["gradients"], rank
