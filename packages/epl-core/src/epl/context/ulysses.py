"""Ulysses attention (DeepSpeed-Ulysses): an all-to-all trades the tokens a device holds for the heads it attends.

Before attention each device holds ``s/c`` tokens of every head; after an all-to-all it holds every token of
``h/c`` heads (and ``h_kv/c`` key/value heads), attends over the whole sequence, and a second all-to-all gives the
output back by tokens. The heads must divide by ``c``. The tokens arrive in device order, not in sequence order:
the masks come from the tokens' facts, so the order does not matter. Per call a device sends ``(c-1)/c`` of its
queries, keys, values and output.
"""

from __future__ import annotations

from typing import Any

import torch

from epl.context.masks import TokenFacts
from epl.context.ring import BlockGradients, ContextGroup, Masking, OnlineSoftmax, gather_facts, grouped
from epl.errors import AnnotationError


def ulysses_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    facts: TokenFacts,
    group: ContextGroup,
    *,
    masking: Masking = Masking(),
    scale: float | None = None,
) -> torch.Tensor:
    """As :func:`epl.context.ring.ring_attention`, by all-to-all over the heads."""
    c = group.count
    if query.shape[1] % c or key.shape[1] % c:
        raise AnnotationError(
            f"context.mode 'ulysses' gives each of the {c} context devices 1/{c} of the heads: this attention has "
            f"{query.shape[1]} query and {key.shape[1]} key/value heads, which {c} does not divide. Use "
            "context.mode 'ring' or 'allgather'."
        )
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    facts_by_device = gather_facts(facts, group)
    everything = TokenFacts(*(torch.cat(parts, 1) for parts in zip(*(
        (f.positions, f.documents, f.valid) for f in facts_by_device), strict=True)))  # fmt: skip
    q, k, v = (_HeadsForTokens.apply(t, group) for t in (query, key, value))
    out = _WholeAttention.apply(q, k, v, everything, masking, scale, c)
    return _TokensForHeads.apply(out, group)


def _exchange(tensor: torch.Tensor, group: ContextGroup) -> torch.Tensor:
    output = torch.empty_like(tensor)
    group.collectives["all_to_all"] += 1
    group.collectives["send_elements"] += tensor.numel() * (group.count - 1) // group.count
    group.communicator.all_to_all(output, tensor).wait()
    return output


def _heads_for_tokens(tensor: torch.Tensor, group: ContextGroup) -> torch.Tensor:
    """``[b, h, t, d]`` (this device's tokens, every head) -> ``[b, h/c, c·t, d]`` (every token, its heads)."""
    b, h, t, d = tensor.shape
    c = group.count
    outgoing = tensor.reshape(b, c, h // c, t, d).permute(1, 0, 2, 3, 4).contiguous()
    received = _exchange(outgoing, group)  # [c (source device), b, h/c, t, d]
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // c, c * t, d)


def _tokens_for_heads(tensor: torch.Tensor, group: ContextGroup) -> torch.Tensor:
    """The inverse of :func:`_heads_for_tokens`."""
    b, hc, ct, d = tensor.shape
    c = group.count
    outgoing = tensor.reshape(b, hc, c, ct // c, d).permute(2, 0, 1, 3, 4).contiguous()
    received = _exchange(outgoing, group)  # [c (source head group), b, h/c, t, d]
    return received.permute(1, 0, 2, 3, 4).reshape(b, c * hc, ct // c, d)


class _HeadsForTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ContextGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _heads_for_tokens(tensor, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _tokens_for_heads(grad.contiguous(), ctx.group), None


class _TokensForHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ContextGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _tokens_for_heads(tensor, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _heads_for_tokens(grad.contiguous(), ctx.group), None


class _WholeAttention(torch.autograd.Function):
    """Attention over the whole sequence on this device's heads, a block of keys at a time (no score matrix of
    the whole sequence is kept)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        facts: TokenFacts,
        masking: Masking,
        scale: float,
        blocks: int,
    ) -> torch.Tensor:
        q = grouped(query, key.shape[1])
        merge = OnlineSoftmax(q)
        for start, length, k, v in _blocks(key, value, blocks):
            merge.add(q, k, v, masking.between(facts, facts.narrow(start, length)), scale)
        output, lse = merge.result()
        ctx.save_for_backward(query, key, value, output, lse)
        ctx.facts, ctx.masking, ctx.scale, ctx.blocks = facts, masking, scale, blocks
        return output.reshape(query.shape)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, output, lse = ctx.saved_tensors
        q = grouped(query, key.shape[1])
        gradients = BlockGradients(q, grouped(grad_output.contiguous(), key.shape[1]), output, lse, ctx.scale)
        dk, dv = [], []
        for start, length, k, v in _blocks(key, value, ctx.blocks):
            block_dk, block_dv = gradients.add(k, v, ctx.masking.between(ctx.facts, ctx.facts.narrow(start, length)))
            dk.append(block_dk)
            dv.append(block_dv)
        return gradients.dq.reshape(query.shape), torch.cat(dk, 2), torch.cat(dv, 2), None, None, None, None


def _blocks(key: torch.Tensor, value: torch.Tensor, blocks: int) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    length = key.shape[2] // blocks
    return [(i * length, length, key.narrow(2, i * length, length), value.narrow(2, i * length, length))
            for i in range(blocks)]  # fmt: skip
