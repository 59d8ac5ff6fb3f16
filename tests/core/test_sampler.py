"""epl.io.ReplicaSampler and epl.io.data_loader: each replica's own share of a dataset, reshuffled each epoch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import IterableDataset, TensorDataset

import epl

DATA = TensorDataset(torch.arange(40))


def shares(count: int, replicas: int, *, epoch: int = 0, **options: object) -> list[list[int]]:
    result = []
    for replica in range(replicas):
        sampler = epl.io.ReplicaSampler(
            TensorDataset(torch.arange(count)), num_replicas=replicas, replica_index=replica, **options
        )
        sampler.set_epoch(epoch)
        result.append(list(sampler))
    return result


def test_replicas_get_disjoint_shares_that_cover_the_data() -> None:
    parts = shares(40, 4)
    assert all(len(part) == 10 for part in parts)
    assert sorted(i for part in parts for i in part) == list(range(40))
    assert parts[0] != list(range(0, 40, 4))  # shuffled


def test_set_epoch_reshuffles_the_same_way_on_every_rank() -> None:
    first, second = shares(40, 2, epoch=0), shares(40, 2, epoch=1)
    assert first != second
    assert sorted(first[0] + first[1]) == sorted(second[0] + second[1]) == list(range(40))
    assert shares(40, 2, epoch=1) == second  # ranks of one replica (same seed, same epoch) read the same share


def test_an_uneven_count_is_padded_or_dropped_so_every_replica_steps_as_often() -> None:
    padded = shares(10, 3)
    assert [len(part) for part in padded] == [4, 4, 4] and set(sum(padded, [])) == set(range(10))
    dropped = shares(10, 3, drop_last=True)
    assert [len(part) for part in dropped] == [3, 3, 3] and len(set(sum(dropped, []))) == 9


def test_data_loader_batches_each_replica_share_equally() -> None:
    loaders = [epl.io.data_loader(DATA, 3, num_replicas=2, replica_index=r, drop_last=True) for r in range(2)]
    batches = [[batch[0].tolist() for batch in loader] for loader in loaders]
    assert [len(b) for b in batches] == [6, 6] and all(len(x) == 3 for b in batches for x in b)
    assert not set(sum(batches[0], [])) & set(sum(batches[1], []))
    loaders[0].sampler.set_epoch(1)  # type: ignore[attr-defined]
    assert [batch[0].tolist() for batch in loaders[0]] != batches[0]


def test_a_local_engine_is_one_replica_reading_everything() -> None:
    epl.init(epl.Config({}))
    engine = epl.parallelize(torch.nn.Linear(1, 1))
    assert sorted(epl.io.ReplicaSampler(DATA, engine)) == list(range(40))


class Stream(IterableDataset):  # type: ignore[type-arg]
    def __iter__(self):  # type: ignore[no-untyped-def]
        yield from range(3)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: epl.io.ReplicaSampler(DATA), "needs engine="),
        # The order the docs once showed: the engine where the batch size goes.
        (lambda: epl.io.data_loader(DATA, SimpleNamespace(num_replicas=2, replica_index=0)), "an Engine as batch_size"),
        (lambda: epl.io.ReplicaSampler(DATA, num_replicas=2, replica_index=2), "replica_index 2 is not in 0..1"),
        (lambda: epl.io.ReplicaSampler(Stream(), num_replicas=2, replica_index=0), "map-style dataset"),
        (
            lambda: epl.io.ReplicaSampler(
                TensorDataset(torch.arange(2)), num_replicas=3, replica_index=0, drop_last=True
            ),
            "drop_last leaves no data",
        ),
    ],
)
def test_bad_sampler_arguments_are_one_clear_error(call, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(epl.ConfigError, match=message):
        call()
