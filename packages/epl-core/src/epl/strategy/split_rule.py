"""The interface of a split rule: how one module type is sharded under ``epl.split``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from torch import nn

if TYPE_CHECKING:
    from epl.comm.protocol import Communicator


class SplitRule(Protocol):
    """Turns a module into the shard that one device of a split TaskGraph holds.

    Called once per module of the split TaskGraph, on every rank of the shard
    group. Must initialise the shard exactly as the unsplit module would be
    (same seed, same values), so split training matches the local run.
    """

    def __call__(self, module: nn.Module, shard_index: int, num_shards: int, communicator: Communicator) -> nn.Module:
        """Return the shard of ``module`` for ``shard_index`` of ``num_shards``."""
        ...
