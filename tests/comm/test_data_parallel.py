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
