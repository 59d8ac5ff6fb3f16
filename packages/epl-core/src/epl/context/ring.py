"""Ring attention: exact attention over a sequence whose tokens are spread over the ``c`` devices of a ring.

Each device keeps its queries and passes its keys and values to the next device, ``c - 1`` times, so that its
queries meet every key (Liu et al. 2023; Megatron-LM's and torch's context parallelism). Partial results merge
by the online softmax (Milakov & Gimelshein 2018), in the input's dtype: float64 stays float64. The backward pass
goes round again with the keys and values, and their gradients travel with them back to their owners. What a
device saves for backward is its own queries, keys, values, output and log-sum-exp: ``s/c`` tokens' worth,
never a score matrix (each block's scores are made, used and freed, in the forward and again in the backward).

Keys and values travel compact: grouped-query attention's ``h_kv`` heads, not expanded to the query heads. A
hop sends one message (keys and values together); the forward's bytes per device are
``2·(c-1)·b·(s/c)·h_kv·d`` elements. Masks are rebuilt per block from the tokens' facts
(:class:`~epl.context.masks.TokenFacts`), which every device gathers once per call.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

import torch

from epl.context.masks import TokenFacts, allowed
from epl.interfaces.communicator import Communicator


@dataclass(eq=False)
class ContextGroup:
    """This device's place in a ring of ``count`` context devices; ``collectives`` counts what the ring sent, by
    kind (``send`` messages and ``send_elements``)."""

    communicator: Communicator
    collectives: collections.Counter[str] = field(default_factory=collections.Counter)

    @property
    def index(self) -> int:
        """This device's place in the ring."""
        return self.communicator.rank

    @property
    def count(self) -> int:
        """Devices in the ring."""
        return self.communicator.world_size

    def shift(self, tensor: torch.Tensor) -> torch.Tensor:
        """Send ``tensor`` to the next device and receive the previous device's (same shape and dtype)."""
        self.collectives["send"] += 1
        self.collectives["send_elements"] += tensor.numel()
        received = torch.empty_like(tensor)
        outgoing = tensor.contiguous()
        sent = self.communicator.send(outgoing, (self.index + 1) % self.count)
        self.communicator.recv(received, (self.index - 1) % self.count).wait()
        sent.wait()
        return received


@dataclass(frozen=True)
class Masking:
    """How queries may attend: ``causal``, within a sliding ``window`` (or None), and the tokens' facts."""

    causal: bool = True
    window: int | None = None

    def between(self, queries: TokenFacts, keys: TokenFacts) -> torch.Tensor:
        """``[batch, queries, keys]``: whether each query attends to each key."""
        return allowed(queries, keys, causal=self.causal, window=self.window)


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    facts: TokenFacts,
    group: ContextGroup,
    *,
    masking: Masking = Masking(),
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of this device's ``query`` ``[b, h, t, d]`` over every device's ``key``/``value``
    ``[b, h_kv, t, d]`` (``h`` a multiple of ``h_kv``); ``facts``: this device's tokens' (``[b, t]``).
    Returns ``[b, h, t, d]``."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    gathered = gather_facts(facts, group)
    return _RingAttention.apply(query, key, value, gathered, group, masking, scale)


def gather_facts(facts: TokenFacts, group: ContextGroup) -> list[TokenFacts]:
    """Every device's token facts, by ring index (small int64 tensors, gathered once per call)."""
    stacked = facts.stacked().contiguous()
    output = stacked.new_empty((group.count, *stacked.shape))
    if group.count > 1:
        group.collectives["all_gather"] += 1
        group.communicator.all_gather(output.view(-1, *stacked.shape[1:]), stacked).wait()
    else:
        output[0] = stacked
    return [TokenFacts.unstacked(piece) for piece in output]


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


class _RingAttention(torch.autograd.Function):
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
        mine = facts[group.index]
        merge = OnlineSoftmax(q)
        k, v = key, value
        for step in range(group.count):
            owner = (group.index - step) % group.count
            if step:
                k, v = _split_kv(group.shift(torch.cat([k, v])), key.shape[0])
            merge.add(q, k, v, masking.between(mine, facts[owner]), scale)
        output, lse = merge.result()
        ctx.save_for_backward(query, key, value, output, lse)
        ctx.facts, ctx.group, ctx.masking, ctx.scale = facts, group, masking, scale
        return output.reshape(query.shape)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, output, lse = ctx.saved_tensors
        group, masking, scale, facts = ctx.group, ctx.masking, ctx.scale, ctx.facts
        q = grouped(query, key.shape[1])
        gradients = BlockGradients(q, grouped(grad_output.contiguous(), key.shape[1]), output, lse, scale)
        mine = facts[group.index]
        k, v = key, value
        dk, dv = torch.zeros_like(key), torch.zeros_like(value)
        for step in range(group.count):
            owner = (group.index - step) % group.count
            if step:  # the keys, values and their gradients so far move on together
                k, v, dk, dv = _split_kv(group.shift(torch.cat([k, v, dk, dv])), key.shape[0])
            block_dk, block_dv = gradients.add(k, v, masking.between(mine, facts[owner]))
            dk, dv = dk + block_dk, dv + block_dv
        dq = gradients.dq
        if group.count > 1:  # one more hop takes each block's gradients home
            dk, dv = _split_kv(group.shift(torch.cat([dk, dv])), key.shape[0])
        return dq.reshape(query.shape), dk, dv, None, None, None, None


def _split_kv(packed: torch.Tensor, batch: int) -> tuple[torch.Tensor, ...]:
    """The tensors concatenated along the batch dimension (keys, values and maybe their gradients)."""
    return tuple(packed.split(batch))
