"""Each replica's share of a list of files or a map-style dataset, by the manual's ``io.*`` keys.

Data is sharded by replica, not by rank: every rank of one replica sees the same
share, since they all receive the same replica batch.
"""

from __future__ import annotations

import os
from collections.abc import Sequence, Sized
from typing import TYPE_CHECKING, TypeVar, cast

from torch.utils.data import Dataset, Subset

from epl.config import Config
from epl.config.settings import CoreSettings
from epl.errors import ConfigError

if TYPE_CHECKING:
    from epl.runtime.engine import Engine

T = TypeVar("T")


def shard(
    data: Sequence[T] | Dataset[T],
    *,
    engine: Engine | None = None,
    num_replicas: int | None = None,
    replica_index: int | None = None,
    config: Config | None = None,
) -> list[T] | Dataset[T]:
    """This replica's share of ``data``: samples (a map-style dataset, as a Subset; a range, a list), or a list
    of files.

    ``engine`` (or ``num_replicas`` and ``replica_index``) says which replica this is;
    ``config`` defaults to the current ``epl.Env``'s. Replica r of R gets items r, r+R, r+2R, ...;
    when the count does not divide, ``io.drop_last_files`` drops the last items so every
    replica gets as many, ``io.unbalanced_io_slicing`` lets some replicas get one more, and
    with neither it is an error. Samples are always shared out. A list of file names (str or
    paths) is shared out only with ``io.slicing`` (the manual's meaning: without it every
    replica reads every file, shuffling on its own).
    """
    if engine is not None:
        num_replicas, replica_index = engine.num_replicas, engine.replica_index
    if num_replicas is None or replica_index is None:
        raise ValueError("epl.io.shard needs engine=..., or num_replicas=... and replica_index=...")
    if not 0 <= replica_index < num_replicas:
        raise ValueError(f"replica_index {replica_index} is not in 0..{num_replicas - 1}")
    if config is None:
        from epl.runtime.env import Env

        config = Env.get().config
    settings = CoreSettings.from_config(config).io
    count = len(cast(Sized, data))  # a map-style dataset has a length, as a sequence does
    indices = share_indices(
        count,
        num_replicas,
        replica_index,
        slicing=settings.slicing or not _is_file_list(data),
        drop_last=settings.drop_last_files,
        unbalanced=settings.unbalanced_io_slicing,
    )
    if isinstance(data, Dataset) and not isinstance(data, Sequence):
        return Subset(data, indices)
    return [data[i] for i in indices]


def share_indices(
    count: int, num_replicas: int, replica_index: int, *, slicing: bool, drop_last: bool, unbalanced: bool
) -> list[int]:
    """Indices of the ``count`` items that replica ``replica_index`` of ``num_replicas`` reads."""
    if not slicing or num_replicas == 1:
        return list(range(count))
    if drop_last:
        count -= count % num_replicas
        if count == 0:
            raise ConfigError(
                f"io.drop_last_files leaves no data: fewer items than the {num_replicas} replicas. "
                "Use more files or fewer replicas."
            )
    elif count % num_replicas:
        if not unbalanced:
            raise ConfigError(
                f"{count} items do not divide evenly over {num_replicas} replicas. Set io.drop_last_files "
                "to drop the last ones, or io.unbalanced_io_slicing to let some replicas read one more."
            )
        if count < num_replicas:
            raise ConfigError(f"{count} items cannot feed {num_replicas} replicas: some would read nothing.")
    return list(range(replica_index, count, num_replicas))


def _is_file_list(data: object) -> bool:
    """Whether ``data`` is a list of file names (str or paths), which ``io.slicing`` governs."""
    return (
        isinstance(data, Sequence)
        and not isinstance(data, (str, bytes))
        and len(data) > 0
        and all(isinstance(item, (str, os.PathLike)) for item in data)
    )
