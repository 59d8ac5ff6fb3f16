"""The devices one split TaskGraph is sharded over, as seen from one of them."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from epl.interfaces.communicator import Communicator


def shard_sizes(size: int, count: int) -> list[int]:
    """Sizes of ``count`` shards of ``size`` items: the first ``size % count`` shards hold one more.

    >>> shard_sizes(1000, 3)
    [334, 333, 333]
    """
    return [size // count + (1 if index < size % count else 0) for index in range(count)]


def shard_slice(size: int, index: int, count: int) -> slice:
    """The items of shard ``index`` of ``count`` (see :func:`shard_sizes`)."""
    sizes = shard_sizes(size, count)
    start = sum(sizes[:index])
    return slice(start, start + sizes[index])


@dataclass(eq=False)
class ShardGroup:
    """This rank's place among the devices of one replica that hold the shards of a split TaskGraph.

    ``batch_split``: the replica batch is also split over these devices (the split
    TaskGraph is colocated with a ``replicate(n)`` one), so each device arrives with
    its own rows and tensor-parallel modules gather rows before computing.
    ``collectives`` counts the collectives the split modules issued, by operation
    (forward and backward).
    """

    communicator: Communicator
    batch_split: bool = False
    collectives: collections.Counter[str] = field(default_factory=collections.Counter)
    #: The last input entered into the shards and its entered form, so layers reading the same input
    #: (q, k and v; gate and up) share one collective: (weak reference to the input, entered, grad enabled).
    entry: tuple[Any, Any, bool] | None = field(default=None, repr=False)
    #: The random state of the column/row regions (``epl.sharding.random.RegionRandom``), or None.
    random: Any = field(default=None, repr=False)
    #: Sequence parallelism (``split.sequence_parallel``): the dimension of the tokens the residual stream is
    #: sharded along between regions, or None.
    sequence_dim: int | None = None
    #: The input a region gathered along the sequence (a weak reference), which its column layers take as it is.
    sequence_entry: Any = field(default=None, repr=False)
    #: How many sequence-parallel regions are running (their row layers reduce-scatter along the sequence).
    sequence_depth: int = 0
    #: The name torch's functional collectives address the communicator's process group by (what a compiled block
    #: traces its collectives on), or None where the communicator has no torch process group.
    traced_group: str | None = field(default=None, init=False)
    #: :attr:`entry` inside a compiled block: (the input, entered), held only while the block is traced (its row
    #: layer clears it), so no block's graph guards on what eager code left in :attr:`entry`.
    traced_entry: tuple[Any, Any] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        asked = getattr(self.communicator, "process_group", None)  # a stand-in (a plan's seat) has none
        group = asked() if callable(asked) else None
        self.traced_group = getattr(group, "group_name", None) if group is not None else None
        self.traced_entry = None  # in the instance's own attributes, as the row layers' clearing leaves it

    @property
    def index(self) -> int:
        """This device's shard."""
        return self.communicator.rank

    @property
    def count(self) -> int:
        """How many shards."""
        return self.communicator.world_size

    def slice(self, size: int) -> slice:
        """This device's items of ``size`` (uneven shards allowed)."""
        return shard_slice(size, self.index, self.count)

    def sizes(self, size: int) -> list[int]:
        """Every device's number of items of ``size``."""
        return shard_sizes(size, self.count)

    def require(self, size: int, what: str) -> None:
        """Raise when ``size`` items of ``what`` leave some device without any."""
        if size < self.count:
            from epl.errors import AnnotationError

            raise AnnotationError(
                f"{what}: {size} cannot be shared by {self.count} devices (some would hold none). "
                f"Split it over at most {size} devices, or create it outside the epl.split scope."
            )
