"""The step runner of a one-stage plan on several processes: the local runner, fed this device's share."""

from __future__ import annotations

from typing import Any

import torch

from epl.plugin_api import Communicator, LocalStepRunner, ReduceOp, split_batch


class DataParallelStepRunner(LocalStepRunner):
    """Runs this rank's share of the replica batch and returns the replica's mean loss.

    Under ``replicate(device_count=k)`` the replica batch is split k ways and this
    rank takes part ``shard_index``; the k losses are averaged over ``replica`` so every
    rank of the replica returns the same value.
    """

    def __init__(self, *, shard_index: int, num_shards: int, replica: Communicator | None, **local: Any) -> None:
        super().__init__(**local)
        self.shard_index = shard_index
        self.num_shards = num_shards
        self.replica = replica

    def share(self, inputs: Any, targets: Any = None) -> tuple[Any, Any]:
        """This rank's part of a replica batch (all of it when the replica's devices do not split the batch)."""
        if self.num_shards > 1:
            what = f"replicate(device_count={self.num_shards})"
            inputs = split_batch(inputs, self.num_shards, what=what)[self.shard_index]
            if targets is not None:
                targets = split_batch(targets, self.num_shards, what=what)[self.shard_index]
        return inputs, targets

    def step(self, inputs: Any, targets: Any = None) -> torch.Tensor:
        """Train on this rank's share of one replica batch; return the replica's mean loss."""
        inputs, targets = self.share(inputs, targets)
        return self._replica_mean(super().step(inputs, targets))

    def evaluate(self, inputs: Any, targets: Any = None) -> torch.Tensor:
        """The loss of this rank's share of one replica batch, without gradients; the replica's mean."""
        inputs, targets = self.share(inputs, targets)
        return self._replica_mean(super().evaluate(inputs, targets))

    def _replica_mean(self, loss: torch.Tensor) -> torch.Tensor:
        if self.replica is not None:
            loss = loss.clone()
            self.replica.all_reduce(loss, ReduceOp.AVG).wait()
        return loss
