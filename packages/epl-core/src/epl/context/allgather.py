"""All-gather attention (Llama 3's context parallelism): every device gathers all keys and values, then attends.

Any mask the token facts can express works here as in the ring. The keys and values are gathered compact
(``h_kv`` heads); the device keeps only its own between forward and backward, and gathers them again for the
backward pass, whose key and value gradients are reduce-scattered to their owners. Per call a device sends, as
the ring does, ``2·(c-1)/c·b·s·h_kv·d`` elements forward.
"""

from __future__ import annotations

from typing import Any

import torch

from epl.context.masks import TokenFacts
from epl.context.ring import BlockGradients, ContextGroup, Masking, OnlineSoftmax, gather_facts, grouped
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
    return _AllGatherAttention.apply(query, key, value, gather_facts(facts, group), group, masking, scale)


def _gather_kv(key: torch.Tensor, value: torch.Tensor, group: ContextGroup) -> list[tuple[torch.Tensor, ...]]:
    """Every device's keys and values, by ring index."""
    packed = torch.cat([key, value]).contiguous()
    if group.count == 1:
        return [(key, value)]
    output = packed.new_empty((group.count * packed.shape[0], *packed.shape[1:]))
    group.collectives["all_gather"] += 1
    group.collectives["send_elements"] += (group.count - 1) * packed.numel()
    group.communicator.all_gather(output, packed).wait()
    return [tuple(piece.split(key.shape[0])) for piece in output.split(packed.shape[0])]


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        facts: list[TokenFacts],
        group: ContextGroup,
        masking: Masking,
        scale: float,
    ) -> torch.Tensor:
        q = grouped(query, key.shape[1])
        merge = OnlineSoftmax(q)
        for owner, (k, v) in enumerate(_gather_kv(key, value, group)):
            merge.add(q, k, v, masking.between(facts[group.index], facts[owner]), scale)
        output, lse = merge.result()
        ctx.save_for_backward(query, key, value, output, lse)
        ctx.facts, ctx.group, ctx.masking, ctx.scale = facts, group, masking, scale
        return output.reshape(query.shape)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, output, lse = ctx.saved_tensors
        group, facts, masking = ctx.group, ctx.facts, ctx.masking
        q = grouped(query, key.shape[1])
        gradients = BlockGradients(q, grouped(grad_output.contiguous(), key.shape[1]), output, lse, ctx.scale)
        pieces = []
        for owner, (k, v) in enumerate(_gather_kv(key, value, group)):
            pieces.append(torch.cat(gradients.add(k, v, masking.between(facts[group.index], facts[owner]))))
        if group.count == 1:
            dk, dv = pieces[0].split(key.shape[0])
        else:  # each block's gradients summed on its owner
            mine = torch.empty_like(pieces[0])
            group.collectives["reduce_scatter"] += 1
            group.communicator.reduce_scatter(mine, torch.cat(pieces).contiguous(), ReduceOp.SUM).wait()
            dk, dv = mine.split(key.shape[0])
        return gradients.dq.reshape(query.shape), dk, dv, None, None, None, None
