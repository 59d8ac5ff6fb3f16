"""Expert parallelism for :class:`epl.nn.Experts`: each device holds a contiguous range of the experts."""

from __future__ import annotations

import torch
from torch import nn

from epl.errors import AnnotationError
from epl.interfaces.split_rule import ShardContext
from epl.nn.moe import Experts, expert_feed_forward
from epl.sharding import collectives as C
from epl.sharding.parameters import sharded_parameter


class ExpertParallelExperts(nn.Module):
    """This device's experts.

    With the batch split over the devices (the manual's recipe), every device
    dispatches its own tokens to all experts; one all-to-all sends each expert's
    tokens to the device that holds it and a second brings the results back.
    Without it, every device has the same tokens, runs its experts on them, and
    the results are all-gathered.
    """

    def __init__(self, experts: Experts, shard: ShardContext) -> None:
        super().__init__()
        if experts.num_experts % shard.count:
            raise AnnotationError(
                f"{shard.name}: {experts.num_experts} experts cannot be shared equally by {shard.count} devices. "
                f"Use a number of experts that is a multiple of {shard.count}."
            )
        self.group = shard.group
        self.num_experts = experts.num_experts
        self.local_experts = experts.num_experts // shard.count
        for name in ("w_in", "b_in", "w_out", "b_out"):
            full = getattr(experts, name)
            setattr(self, name, sharded_parameter(full, group=self.group, dim=0))

    def forward(self, dispatched: torch.Tensor) -> torch.Tensor:
        """[num_experts, slots, d_model] in, the same out: every expert's tokens, processed."""
        group, local = self.group, self.local_experts
        if not group.batch_split:
            sizes = [local] * group.count
            mine = C.split_to_shards(dispatched, group, 0, sizes)
            return C.gather_from_shards(self._run(mine), group, 0, sizes)
        experts, slots, width = dispatched.shape
        received = C.all_to_all(dispatched, group)  # chunk i: device i's tokens for my experts
        by_expert = received.reshape(group.count, local, slots, width).transpose(0, 1).reshape(local, -1, width)
        processed = self._run(by_expert)
        back = processed.reshape(local, group.count, slots, width).transpose(0, 1).reshape(experts, slots, width)
        return C.all_to_all(back, group)

    def _run(self, tokens: torch.Tensor) -> torch.Tensor:
        return expert_feed_forward(tokens, self.w_in, self.b_in, self.w_out, self.b_out)

    def extra_repr(self) -> str:
        """What ``print(model)`` shows of this layer."""
        first = self.group.index * self.local_experts
        return f"experts {first}..{first + self.local_experts - 1} of {self.num_experts}"


def shard_experts(module: Experts, shard: ShardContext) -> nn.Module:
    """The split rule for :class:`epl.nn.Experts`: expert parallel."""
    return ExpertParallelExperts(module, shard)
