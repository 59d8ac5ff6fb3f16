"""Ulysses attention (DeepSpeed-Ulysses): an all-to-all trades the tokens a device holds for the heads it attends.

Before attention each device holds ``s/c`` tokens of every head; after an all-to-all it holds every token of
``h/c`` heads (and ``h_kv/c`` key/value heads), attends over the whole sequence, and a second all-to-all gives the
output back by tokens. The heads must divide by ``c``. The tokens arrive in device order, not in sequence order:
the masks come from the tokens' facts, so the order does not matter. Per call a device sends ``(c-1)/c`` of its
queries, keys, values and output.

When the mask is the plain one (one document per sequence, no padding, positions ``0..s-1``, no sliding window
that binds) the whole sequence is put back in order and attended by ``scaled_dot_product_attention``, torch's fused
kernels on CPU and CUDA (DeepSpeed-Ulysses does the same); any other mask goes block by block from the facts
(:mod:`epl.context.blockwise`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from epl.context.blockwise import KeySlices, blockwise_attention
from epl.context.chunks import shard_sequence, unshard_sequence
from epl.context.masks import Masking, TokenFacts, merged_runs
from epl.context.ring import ContextGroup, gather_facts
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
    everything = TokenFacts.concatenated(facts_by_device)
    q, k, v = (_Regroup.apply(t, group, True) for t in (query, key, value))
    if _plain(everything, masking, c):
        out = _in_sequence_order(q, k, v, c, masking.causal, scale)
    else:
        out = blockwise_attention(q, k, v, everything, KeySlices(everything, c), masking, scale)
    return _Regroup.apply(out, group, False)


def _plain(everything: TokenFacts, masking: Masking, count: int) -> bool:
    """Whether the facts (of every token, in device order) make the plain mask: one document, no padding,
    positions ``0..s-1``, and no sliding window shorter than the sequence."""
    batch, length = everything.positions.shape
    if masking.window is not None and masking.window < length:
        return False
    if everything.runs is not None:  # known on the host: the runs tile 0..s-1
        return merged_runs(sorted(everything.runs)) == ((0, length),)
    if not bool(everything.valid.all()) or not bool((everything.documents == everything.documents[:, :1]).all()):
        return False
    ordered = unshard_sequence(list(everything.positions.split(length // count, 1)), 1)
    return torch.equal(ordered, torch.arange(length, device=ordered.device).expand(batch, length))


def _in_sequence_order(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int, causal: bool, scale: float
) -> torch.Tensor:
    """Attention of the whole sequence (tokens in device order, ``[b, h/c, s, d]``) by torch's fused kernels, in
    sequence order; the output back in device order."""
    share = q.shape[2] // count
    q, k, v = (unshard_sequence(list(t.split(share, 2)), 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
    return torch.cat([shard_sequence(out, 2, device, count) for device in range(count)], 2)


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


class _Regroup(torch.autograd.Function):
    """:func:`_heads_for_tokens` forward (``to_heads``) or :func:`_tokens_for_heads`; the other backward."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ContextGroup, to_heads: bool) -> torch.Tensor:
        ctx.group, ctx.to_heads = group, to_heads
        return (_heads_for_tokens if to_heads else _tokens_for_heads)(tensor, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        inverse = _tokens_for_heads if ctx.to_heads else _heads_for_tokens
        return inverse(grad.contiguous(), ctx.group), None, None
