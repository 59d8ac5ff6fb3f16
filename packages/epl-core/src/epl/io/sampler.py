"""The PyTorch way to feed replicas: a sampler of this replica's share of a map-style dataset.

:class:`ReplicaSampler` is torch's ``DistributedSampler`` counted in replicas rather than
ranks: replica r of R reads its own R-th of the dataset's (shuffled) indices, and every rank
of one replica reads the same ones, since they all take part in the same replica batch.
``set_epoch`` reshuffles, ``drop_last`` drops the tail that does not share out evenly (else
it is padded by repeating indices, so every replica gets as many).

Each sampler also records where it is in the data (:func:`data_position`). The step check
(``communication.check_steps``) compares it across the ranks that average gradients, so a
rank that skipped or repeated a step is named at the first step whose batches differ.

Checkpoints record where each sampler stands (:meth:`ReplicaSampler.state_dict`: the epoch and the samples of
it consumed over all replicas), and ``engine.load`` resumes it on any number of replicas: the rest of the
epoch's order is shared out anew (:mod:`epl.io.positions`). :class:`ReplicaLoader`, what :func:`data_loader`
returns, counts the batches it has given out, so the position is what was trained on, whatever its workers
fetched ahead.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Iterator, Sized
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

from torch.utils.data import DataLoader, Dataset, DistributedSampler

from epl.errors import ConfigError, EplError
from epl.io import positions

T = TypeVar("T")

_serials = itertools.count(1)
#: The sampler that drew an index last in this process.
_latest: weakref.ref[ReplicaSampler[Any]] | None = None
#: DataLoader arguments :func:`data_loader` sets itself.
_OWN_OPTIONS = ("sampler", "batch_sampler", "shuffle")


class ReplicaSource(Protocol):
    """What tells a sampler which replica it feeds (an :class:`epl.Engine`)."""

    @property
    def num_replicas(self) -> int:
        """How many replicas train in parallel."""
        ...

    @property
    def replica_index(self) -> int:
        """Which replica this rank belongs to."""
        ...


@dataclass
class _Pass:
    """One pass over an epoch's indices (one ``iter``): where it began and how much of it was consumed."""

    epoch: int
    #: Samples of the epoch consumed over all replicas before this pass (0: a whole pass).
    start: int
    #: This replica's indices in the pass.
    length: int
    #: Of them, consumed: counted by the :class:`ReplicaLoader` (batches given out), else the indices drawn.
    consumed: int = 0
    #: Whether the pass ran to its end (the loader's iterator, or the sampler's, was exhausted).
    finished: bool = False


class ReplicaSampler(DistributedSampler[T]):
    """This replica's share of a map-style ``dataset``, reshuffled each epoch (call ``set_epoch``).

    ``engine`` (or ``num_replicas`` and ``replica_index``) says which replica this is. The other
    arguments are ``DistributedSampler``'s: ``shuffle`` with ``seed`` (the same on every rank),
    ``drop_last`` to drop the indices that do not share out evenly instead of repeating some.

    ``engine.save`` records where it stands and ``engine.load`` resumes it (:meth:`state_dict`), on any number
    of replicas, whether it is built before or after the load. Build it after ``epl.init``, in the same order
    on every rank: samplers are matched to the checkpoint's by their order of creation (see
    :mod:`epl.io.positions`).
    """

    def __init__(
        self,
        dataset: Dataset[T],
        engine: ReplicaSource | None = None,
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
        self._pass: _Pass | None = None
        #: (epoch, samples consumed over all replicas): where the next pass of that epoch starts (engine.load).
        self._resume: tuple[int, int] | None = None
        #: Whether a :class:`ReplicaLoader` counts what is consumed (else the indices drawn count).
        self._counted = False
        positions.register(self)  # restores the position engine.load left for it, if any

    def __iter__(self) -> Iterator[T]:
        start = self._take_resume()
        indices = list(super().__iter__()) if start == 0 else self._rest(start)
        current = _Pass(self.epoch, start, len(indices))
        self._pass = current
        self.passes, self.drawn = self.passes + 1, 0
        return self._draw(indices, current)

    def _draw(self, indices: list[T], current: _Pass) -> Iterator[T]:
        global _latest
        for index in indices:
            self.drawn += 1
            if not self._counted:
                current.consumed = self.drawn
            _latest = self._ref
            yield index
        if not self._counted:
            current.finished = True

    # -- where it stands --------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where this sampler stands, as plain data (what ``engine.save`` records): the ``epoch``, ``position``
        (samples of the epoch consumed over all replicas, while ``in_pass``), and what fixes the order of the
        data (``dataset_length``, ``shuffle``, ``seed``, ``drop_last``)."""
        epoch, position, in_pass = self._where()
        return {
            "epoch": epoch,
            "position": position,
            "in_pass": in_pass,
            "counted": self._counted,
            "num_replicas": self.num_replicas,
            "dataset_length": self._size(),
            "shuffle": bool(self.shuffle),
            "seed": int(self.seed),
            "drop_last": bool(self.drop_last),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a :meth:`state_dict`, saved on any number of replicas: the epoch is set, and the next pass
        over that epoch gives this replica its share of the samples not yet consumed (the rest of the epoch's
        order, shared out over this sampler's replicas as ``DistributedSampler`` shares a whole epoch). ``len``
        stays torch's (a whole epoch's share), so ``engine.global_step // len(loader)`` is still the epoch.

        Raises :class:`epl.EplError` when it cannot be resumed exactly (other data, shuffle or seed; a position
        counted by a DataLoader of the user's).
        """
        problem = self.resume_problem(state)
        if problem is not None:
            raise EplError(problem)
        epoch, position = positions.where(state)
        self.set_epoch(epoch)
        self._resume = (epoch, position) if position else None
        self._pass = None

    def resume_problem(self, state: dict[str, Any]) -> str | None:
        """Why ``state`` (a :meth:`state_dict`) cannot be resumed exactly by this sampler (None: it can)."""
        mine = {"dataset_length": self._size(), "shuffle": bool(self.shuffle), "seed": int(self.seed)}
        mine["drop_last"] = bool(self.drop_last)
        changed = [f"{key}={state[key]} (this loader: {value})" for key, value in mine.items() if state[key] != value]
        if changed:
            return (
                f"The checkpoint's {positions.describe(state)} cannot be resumed by this one: it was saved with "
                f"{', '.join(changed)}, so the rest of its epoch is not this loader's. Build the loaders as they "
                "were saved, in the same order, or pass strict=False to engine.load to start it afresh."
            )
        if positions.where(state)[1] and not state["counted"]:
            return (
                f"The checkpoint's {positions.describe(state)} was saved in the middle of an epoch "
                f"({positions.at(state)}) from a DataLoader of your own, whose workers fetch ahead: EPL cannot tell "
                "what was trained on, so it cannot resume it exactly. Build the loader with epl.io.data_loader (it "
                "takes DataLoader's options), or pass strict=False to engine.load to start it afresh."
            )
        return None

    def _where(self) -> tuple[int, int, bool]:
        """(epoch, samples of it consumed over all replicas, whether a pass over it is under way)."""
        resume, current = self._resume, self._pass
        if resume is not None and resume[0] == self.epoch:
            return self.epoch, resume[1], True
        if current is not None and not current.finished and current.epoch == self.epoch:
            consumed = min(current.start + current.consumed * self.num_replicas, self._size())
            return self.epoch, consumed, True
        return self.epoch, 0, False

    def _take_resume(self) -> int:
        """Where the pass that starts now begins (a restored position applies to the next pass over its epoch)."""
        resume, self._resume = self._resume, None
        return resume[1] if resume is not None and resume[0] == self.epoch else 0

    def _order(self) -> list[int]:
        """The epoch's order of the whole dataset, as ``DistributedSampler`` draws it."""
        if not self.shuffle:
            return list(range(self._size()))
        import torch

        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(self._size(), generator=generator).tolist()

    def _rest(self, start: int) -> list[Any]:
        """This replica's share of the epoch's order from ``start`` on, shared out as ``DistributedSampler`` shares
        a whole epoch: interleaved, the tail padded by repeating indices (or dropped with ``drop_last``)."""
        rest = self._order()[start:]
        total = self._share(len(rest)) * self.num_replicas
        if not rest:
            return []
        if total > len(rest):
            rest = (rest * math.ceil(total / len(rest)))[:total]
        return rest[self.rank : total : self.num_replicas]

    def _share(self, count: int) -> int:
        """Indices each replica gets when ``count`` are shared out."""
        if count <= 0:
            return 0
        return count // self.num_replicas if self.drop_last else math.ceil(count / self.num_replicas)

    def _size(self) -> int:
        return len(cast(Sized, self.dataset))  # DistributedSampler takes a dataset with a length


class ReplicaLoader(DataLoader[T]):
    """A ``DataLoader`` over a :class:`ReplicaSampler` that counts the batches it gives out, so that
    ``engine.save`` records what was trained on, not what its workers fetched ahead (what :func:`data_loader`
    returns). ``state_dict`` and ``load_state_dict`` are its sampler's."""

    def __init__(self, dataset: Dataset[T], batch_size: int, sampler: ReplicaSampler[Any], **options: Any) -> None:
        _refuse_own_options(options)
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, **options)
        sampler._counted = True

    def __iter__(self) -> Iterator[T]:  # type: ignore[override]  # a counting iterator, not torch's own
        sampler = self.sampler
        assert isinstance(sampler, ReplicaSampler)
        return _Counting(super().__iter__(), sampler, self.batch_size or 1)

    def state_dict(self) -> dict[str, Any]:
        """Where the loader stands: its sampler's :meth:`ReplicaSampler.state_dict`."""
        return cast(ReplicaSampler[Any], self.sampler).state_dict()  # __init__ takes a ReplicaSampler only

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a :meth:`state_dict` (see :meth:`ReplicaSampler.load_state_dict`)."""
        cast(ReplicaSampler[Any], self.sampler).load_state_dict(state)


class _Counting:
    """A ``DataLoader`` iterator that tells its sampler's pass how many samples it has given out."""

    def __init__(self, inner: Iterator[Any], sampler: ReplicaSampler[Any], batch_size: int) -> None:
        self._inner = inner
        self._sampler = sampler
        self._batch_size = batch_size
        self._batches = 0
        self._pass: _Pass | None = None

    def __iter__(self) -> _Counting:
        return self

    def __next__(self) -> Any:
        try:
            batch = next(self._inner)
        except StopIteration:
            current = self._pass or self._sampler._pass
            if current is not None:
                current.finished = True
            raise
        if self._pass is None:  # the pass began with this iterator's first batch (or its workers' first fetch)
            self._pass = self._sampler._pass
        self._batches += 1
        if self._pass is not None:
            self._pass.consumed = min(self._batches * self._batch_size, self._pass.length)
        return batch

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]  # a DataLoader's iterator, which has a length

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _refuse_own_options(options: dict[str, Any]) -> None:
    given = [name for name in _OWN_OPTIONS if name in options]
    if given:
        raise EplError(
            f"epl.io.data_loader shares the data out with its own ReplicaSampler, so it takes no {given[0]}=: EPL "
            "cannot resume a custom sampler from a checkpoint. Use DataLoader(dataset, sampler=...) yourself (and "
            "resume it yourself), or epl.io.data_loader without it."
        )


def data_position() -> tuple[int, int, int] | None:
    """(serial, pass, indices drawn in it) of the :class:`ReplicaSampler` that drew last in this process, or
    None when none has."""
    sampler = _latest() if _latest is not None else None
    return None if sampler is None else (sampler.serial, sampler.passes, sampler.drawn)


def data_loader(
    dataset: Dataset[T],
    batch_size: int,
    engine: ReplicaSource | None = None,
    *,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    num_replicas: int | None = None,
    replica_index: int | None = None,
    **options: Any,
) -> ReplicaLoader[T]:
    """A ``DataLoader`` of this replica's share of ``dataset`` in batches of ``batch_size`` (the replica batch).

    Its sampler is a :class:`ReplicaSampler` (``loader.sampler.set_epoch(epoch)`` reshuffles);
    ``drop_last`` applies to both the share (no repeated indices) and the last, smaller batch.
    ``options`` go to ``DataLoader`` (``num_workers``, ``collate_fn``, ``pin_memory``...). ``engine.save``
    records where it stands and ``engine.load`` resumes it, on any number of replicas (see
    docs/checkpoints.md).
    """
    if hasattr(batch_size, "replica_index"):  # data_loader(dataset, engine, ...): the engine in batch_size's place
        raise ConfigError(
            "epl.io.data_loader(dataset, batch_size, engine): got an Engine as batch_size "
            f"({type(batch_size).__name__}). Pass the replica batch size second and the engine third: "
            "epl.io.data_loader(dataset, 32, engine)."
        )
    _refuse_own_options(options)
    sampler = ReplicaSampler(
        dataset, engine, num_replicas=num_replicas, replica_index=replica_index, shuffle=shuffle, seed=seed,
        drop_last=drop_last,
    )  # fmt: skip
    return ReplicaLoader(dataset, batch_size, sampler, drop_last=drop_last, **options)
