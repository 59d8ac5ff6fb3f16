"""The PyTorch way to feed replicas: a sampler of this replica's share of a map-style dataset.

:class:`ReplicaSampler` is torch's ``DistributedSampler`` counted in replicas rather than
ranks: replica r of R reads its own R-th of the dataset's (shuffled) indices, and every rank
of one replica reads the same ones, since they all take part in the same replica batch.
``set_epoch`` reshuffles, ``drop_last`` drops the tail that does not share out evenly (else
it is padded by repeating indices, so every replica gets as many).

Each sampler also records where it is in the data (:func:`data_position`). The step check
(``communication.check_steps``) compares it across the ranks that average gradients, so a
rank that skipped or repeated a step is named at the first step whose batches differ.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator, Sized
from typing import TYPE_CHECKING, Any, TypeVar

from torch.utils.data import DataLoader, Dataset, DistributedSampler

from epl.errors import ConfigError

if TYPE_CHECKING:
    from epl.runtime.engine import Engine

T = TypeVar("T")

_serials = itertools.count(1)
#: The sampler that drew an index last in this process.
_latest: weakref.ref[ReplicaSampler[Any]] | None = None


class ReplicaSampler(DistributedSampler[T]):
    """This replica's share of a map-style ``dataset``, reshuffled each epoch (call ``set_epoch``).

    ``engine`` (or ``num_replicas`` and ``replica_index``) says which replica this is. The other
    arguments are ``DistributedSampler``'s: ``shuffle`` with ``seed`` (the same on every rank),
    ``drop_last`` to drop the indices that do not share out evenly instead of repeating some.
    """

    def __init__(
        self,
        dataset: Dataset[T],
        engine: Engine | None = None,
        *,
        num_replicas: int | None = None,
        replica_index: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if engine is not None:
            num_replicas, replica_index = engine.num_replicas, engine.replica_index
        if num_replicas is None or replica_index is None:
            raise ConfigError(
                "epl.io.ReplicaSampler needs engine=... (or num_replicas=... and replica_index=...): how the data "
                "is shared out is known once epl.parallelize has built the engine."
            )
        if not 0 <= replica_index < num_replicas:
            raise ConfigError(f"replica_index {replica_index} is not in 0..{num_replicas - 1}.")
        size = len(dataset) if isinstance(dataset, Sized) else None
        if size is None:
            raise ConfigError(
                "epl.io.ReplicaSampler needs a map-style dataset with a length (an IterableDataset shares out its "
                "own data: give it this replica's files with epl.io.shard)."
            )
        if drop_last and size < num_replicas:
            raise ConfigError(
                f"drop_last leaves no data: the dataset has {size} items for {num_replicas} replicas. Use "
                "drop_last=False (indices are repeated to share out evenly) or fewer replicas."
            )
        super().__init__(
            dataset, num_replicas=num_replicas, rank=replica_index, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        #: Order of creation in this process (ranks that build the same samplers give them the same serials).
        self.serial = next(_serials)
        #: Passes over the data started (each ``iter``), and indices drawn in the current one.
        self.passes, self.drawn = 0, 0
        self._ref = weakref.ref(self)

    def __iter__(self) -> Iterator[T]:  # type: ignore[override]
        global _latest
        self.passes, self.drawn = self.passes + 1, 0
        for index in super().__iter__():
            self.drawn += 1
            _latest = self._ref
            yield index


def data_position() -> tuple[int, int, int] | None:
    """(serial, pass, indices drawn in it) of the :class:`ReplicaSampler` that drew last in this process, or
    None when none has."""
    sampler = _latest() if _latest is not None else None
    return None if sampler is None else (sampler.serial, sampler.passes, sampler.drawn)


def data_loader(
    dataset: Dataset[T],
    batch_size: int,
    engine: Engine | None = None,
    *,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    num_replicas: int | None = None,
    replica_index: int | None = None,
    **options: Any,
) -> DataLoader[T]:
    """A ``DataLoader`` of this replica's share of ``dataset`` in batches of ``batch_size`` (the replica batch).

    Its sampler is a :class:`ReplicaSampler` (``loader.sampler.set_epoch(epoch)`` reshuffles);
    ``drop_last`` applies to both the share (no repeated indices) and the last, smaller batch.
    ``options`` go to ``DataLoader`` (``num_workers``, ``collate_fn``, ``pin_memory``...).
    """
    sampler = ReplicaSampler(
        dataset, engine, num_replicas=num_replicas, replica_index=replica_index, shuffle=shuffle, seed=seed,
        drop_last=drop_last,
    )  # fmt: skip
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **options)
