"""All-gather attention (Llama 3's context parallelism): every device gathers all keys and values, then attends.

Any mask the token facts can express works here as in the ring. The keys and values are gathered compact
(``h_kv`` heads); the device keeps only its own between forward and backward, and gathers them again for the
backward pass, whose key and value gradients are reduce-scattered to their owners. Per call a device sends, as
the ring does, ``2·(c-1)/c·b·s·h_kv·d`` elements forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from epl.context.blockwise import BlockGradientsOf, blockwise_attention
from epl.context.masks import Masking, TokenFacts
from epl.context.ring import ContextGroup, gather_facts
from epl.interfaces.communicator import ReduceOp


def allgather_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    facts: TokenFacts,
    group: ContextGroup,
    *,
    masking: Masking = Masking(),
    scale: float | None = None,
) -> torch.Tensor:
    """As :func:`epl.context.ring.ring_attention`, with the keys and values all-gathered instead of passed on."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return blockwise_attention(query, key, value, facts, _Gathered(group, gather_facts(facts, group)), masking, scale)


@dataclass(eq=False)
class _Gathered:
    """Every device's keys and values, gathered (again for the backward pass, whose gradients are
    reduce-scattered to their owners)."""

    group: ContextGroup
    facts: list[TokenFacts]

    def forward(
        self, key: torch.Tensor, value: torch.Tensor
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, TokenFacts]]:
        """Each device's keys and values, by ring index."""
        for owner, (k, v) in enumerate(self._gather(key, value)):
            yield k, v, self.facts[owner]

    def backward(
        self, key: torch.Tensor, value: torch.Tensor, gradients_of: BlockGradientsOf
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every block's gradients, each summed on its owner."""
        pieces = [torch.cat(gradients_of(k, v, keys)) for k, v, keys in self.forward(key, value)]
        if self.group.count == 1:
            return tuple(pieces[0].split(key.shape[0]))
        mine = torch.empty_like(pieces[0])
        self.group.collectives["reduce_scatter"] += 1
        self.group.communicator.reduce_scatter(mine, torch.cat(pieces).contiguous(), ReduceOp.SUM).wait()
        return tuple(mine.split(key.shape[0]))

    def _gather(self, key: torch.Tensor, value: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        group = self.group
        if group.count == 1:
            return [(key, value)]
        packed = torch.cat([key, value]).contiguous()
        output = packed.new_empty((group.count * packed.shape[0], *packed.shape[1:]))
        group.collectives["all_gather"] += 1
        group.collectives["send_elements"] += (group.count - 1) * packed.numel()
        group.communicator.all_gather(output, packed).wait()
        return [tuple(piece.split(key.shape[0])) for piece in output.split(packed.shape[0])]
