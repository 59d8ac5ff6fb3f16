"""Exact attention a block of keys at a time: the online softmax forward, FlashAttention's backward.

The queries stay on their device; the keys and values come in blocks from a :class:`KeyBlocks`, which also says
where each block's gradients go: round a ring (:mod:`epl.context.ring`), reduce-scattered to their owners
(:mod:`epl.context.allgather`), or kept (:mod:`epl.context.ulysses`). Partial results merge by the online
softmax (Milakov & Gimelshein 2018) in the input's dtype: float64 stays float64. A device saves for backward only
its queries, keys, values, output and log-sum-exp, never a score matrix (each block's scores are made, used and
freed, in the forward and again in the backward). Keys and values stay compact: grouped-query attention's
``h_kv`` heads, not expanded to the query heads. Masks are rebuilt per block from the tokens' facts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from epl.context.masks import Masking, TokenFacts

#: The gradients of one block of keys and values, given the block and its tokens' facts.
BlockGradientsOf = Callable[[torch.Tensor, torch.Tensor, TokenFacts], tuple[torch.Tensor, torch.Tensor]]


class KeyBlocks(Protocol):
    """Where a device's blocks of keys and values come from, and where their gradients go."""

    def forward(
        self, key: torch.Tensor, value: torch.Tensor
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, TokenFacts]]:
        """Each block of keys and values ``[b, h_kv, s, d]`` with its tokens' facts, this device's ``key`` and
        ``value`` among them."""
        ...

    def backward(
        self, key: torch.Tensor, value: torch.Tensor, gradients_of: BlockGradientsOf
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradients of this device's ``key`` and ``value``: every block's, from ``gradients_of``, brought to
        the blocks' owners."""
        ...


def blockwise_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    queries: TokenFacts,
    blocks: KeyBlocks,
    masking: Masking,
    scale: float,
) -> torch.Tensor:
    """Attention of ``query`` ``[b, h, t, d]`` (its tokens' facts ``queries``) over every block of ``blocks``;
    ``key``/``value`` ``[b, h_kv, s, d]`` are this device's (``h`` a multiple of ``h_kv``). Returns ``[b, h, t, d]``."""
    return _BlockwiseAttention.apply(query, key, value, queries, blocks, masking, scale)


def grouped(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[b, h, t, d]`` as ``[b, h_kv, g, t, d]``: the query heads sharing each key/value head together."""
    b, h, t, d = query.shape
    return query.reshape(b, kv_heads, h // kv_heads, t, d)


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``[b, h_kv, g, t_q, t_k]`` scaled scores, masked entries ``-inf``."""
    scores = torch.einsum("bkgqd,bksd->bkgqs", q, k) * scale
    return scores.masked_fill(~mask[:, None, None], float("-inf"))


class OnlineSoftmax:
    """Attention of queries ``q`` ``[b, h_kv, g, t, d]`` over blocks of keys added one by one: the running max, sum
    of exponentials and unnormalised output, in the input's dtype."""

    def __init__(self, q: torch.Tensor) -> None:
        self.running_max = q.new_full(q.shape[:-1], float("-inf"))
        self.running_sum = q.new_zeros(q.shape[:-1])
        self.output = torch.zeros_like(q)

    def add(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> None:
        """Take in one block of keys and values (``[b, h_kv, s, d]``) under ``mask`` ``[b, t, s]``."""
        scores = _scores(q, k, mask, scale)
        new_max = torch.maximum(self.running_max, scores.amax(-1))
        safe = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
        weights = torch.exp(scores - safe[..., None])
        rescale = torch.exp(self.running_max - safe)
        self.running_sum = self.running_sum * rescale + weights.sum(-1)
        self.output = self.output * rescale[..., None] + torch.einsum("bkgqs,bksd->bkgqd", weights, v)
        self.running_max = new_max

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention output and the log-sum-exp of each query's scores (``-inf`` for one that attends to
        nothing, whose output is 0, as a masked row)."""
        empty = self.running_sum == 0
        output = self.output / torch.where(empty, torch.ones_like(self.running_sum), self.running_sum)[..., None]
        finite = self.running_max + self.running_sum.log()
        lse = torch.where(empty, torch.full_like(self.running_sum, float("-inf")), finite)
        return output, lse


class BlockGradients:
    """The backward pass of :class:`OnlineSoftmax`, block by block, from the final output and log-sum-exp (as
    FlashAttention's): accumulates the queries' gradient, returns each block's keys' and values' gradients."""

    def __init__(
        self, q: torch.Tensor, dout: torch.Tensor, output: torch.Tensor, lse: torch.Tensor, scale: float
    ) -> None:
        self.q, self.dout, self.scale = q, dout, scale
        self.delta = (dout * output).sum(-1)  # D = rowsum(dO ∘ O)
        self.empty = torch.isinf(lse)
        self.lse = torch.where(self.empty, torch.zeros_like(lse), lse)
        self.dq = torch.zeros_like(q)

    def add(self, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradients of block ``k``, ``v`` (and its share of the queries', kept)."""
        probabilities = torch.exp(_scores(self.q, k, mask, self.scale) - self.lse[..., None])
        probabilities = probabilities.masked_fill(self.empty[..., None], 0.0)
        dv = torch.einsum("bkgqs,bkgqd->bksd", probabilities, self.dout)
        dscores = probabilities * (torch.einsum("bkgqd,bksd->bkgqs", self.dout, v) - self.delta[..., None])
        self.dq = self.dq + torch.einsum("bkgqs,bksd->bkgqd", dscores, k) * self.scale
        return torch.einsum("bkgqs,bkgqd->bksd", dscores, self.q) * self.scale, dv


class _BlockwiseAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        queries: TokenFacts,
        blocks: KeyBlocks,
        masking: Masking,
        scale: float,
    ) -> torch.Tensor:
        q = grouped(query, key.shape[1])
        merge = OnlineSoftmax(q)
        for k, v, keys in blocks.forward(key, value):
            merge.add(q, k, v, masking.between(queries, keys), scale)
        output, lse = merge.result()
        ctx.save_for_backward(query, key, value, output, lse)
        ctx.queries, ctx.blocks, ctx.masking, ctx.scale = queries, blocks, masking, scale
        return output.reshape(query.shape)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, output, lse = ctx.saved_tensors
        q = grouped(query, key.shape[1])
        gradients = BlockGradients(q, grouped(grad_output.contiguous(), key.shape[1]), output, lse, ctx.scale)

        def gradients_of(k: torch.Tensor, v: torch.Tensor, keys: TokenFacts) -> tuple[torch.Tensor, torch.Tensor]:
            return gradients.add(k, v, ctx.masking.between(ctx.queries, keys))

        dk, dv = ctx.blocks.backward(key, value, gradients_of)
        return gradients.dq.reshape(query.shape), dk, dv, None, None, None, None
