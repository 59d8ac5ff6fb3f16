"""epl.io.shard: each replica's share of a file list or a map-style dataset, by the manual's io.* keys."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Subset, TensorDataset

import epl

FILES = [f"part-{i:02d}" for i in range(10)]


def config(**keys: bool | int) -> epl.Config:
    return epl.Config({f"io.{k}": bool(v) for k, v in keys.items()})


def test_without_slicing_every_replica_reads_every_file() -> None:
    assert epl.io.shard(FILES, num_replicas=4, replica_index=2, config=config()) == FILES


def test_samples_are_shared_out_without_slicing() -> None:
    """io.slicing is about file lists: a dataset, a range or a list of samples is always shared out."""
    dataset = TensorDataset(torch.arange(8))
    share = epl.io.shard(dataset, num_replicas=2, replica_index=1, config=config())
    assert [int(share[i][0]) for i in range(len(share))] == [1, 3, 5, 7]
    assert epl.io.shard(range(8), num_replicas=2, replica_index=0, config=config()) == [0, 2, 4, 6]
    with pytest.raises(epl.ConfigError, match="do not divide evenly"):
        epl.io.shard(range(7), num_replicas=2, replica_index=0, config=config())


def test_slicing_gives_disjoint_shares_that_cover_the_data() -> None:
    shares = [epl.io.shard(FILES, num_replicas=5, replica_index=r, config=config(slicing=True)) for r in range(5)]
    assert shares[1] == ["part-01", "part-06"]
    assert sorted(f for share in shares for f in share) == FILES


def test_uneven_count_is_an_error_unless_dropped_or_allowed() -> None:
    with pytest.raises(epl.ConfigError, match=r"10 items do not divide evenly over 4 replicas.*io.drop_last_files"):
        epl.io.shard(FILES, num_replicas=4, replica_index=0, config=config(slicing=True))
    dropped = [
        epl.io.shard(FILES, num_replicas=4, replica_index=r, config=config(slicing=True, drop_last_files=True))
        for r in range(4)
    ]
    assert [len(s) for s in dropped] == [2, 2, 2, 2] and "part-08" not in sum(dropped, [])
    unbalanced = [
        epl.io.shard(FILES, num_replicas=4, replica_index=r, config=config(slicing=True, unbalanced_io_slicing=True))
        for r in range(4)
    ]
    assert [len(s) for s in unbalanced] == [3, 3, 2, 2]
    with pytest.raises(epl.ConfigError, match="3 items cannot feed 4 replicas"):
        epl.io.shard(
            FILES[:3], num_replicas=4, replica_index=0, config=config(slicing=True, unbalanced_io_slicing=True)
        )


def test_map_style_dataset_becomes_a_subset() -> None:
    dataset = TensorDataset(torch.arange(8))
    share = epl.io.shard(dataset, num_replicas=2, replica_index=1, config=config(slicing=True))
    assert isinstance(share, Subset) and [int(share[i][0]) for i in range(len(share))] == [1, 3, 5, 7]


def test_engine_and_env_config_are_used_by_default() -> None:
    epl.init(config(slicing=True))
    engine = epl.parallelize(torch.nn.Linear(1, 1))
    assert epl.io.shard(FILES, engine=engine) == FILES  # one replica reads everything
    with pytest.raises(ValueError, match="needs engine"):
        epl.io.shard(FILES)
