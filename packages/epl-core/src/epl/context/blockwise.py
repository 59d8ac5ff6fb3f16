"""Exact attention a block of keys at a time: the online softmax forward, FlashAttention's backward.

The queries stay on their device; the keys and values come in blocks from a :class:`KeyBlocks`, which also says
where each block's gradients go: round a ring (:mod:`epl.context.ring`), reduce-scattered to their owners
(:mod:`epl.context.allgather`), or kept (:mod:`epl.context.ulysses`). Partial results merge by the online
softmax (Milakov & Gimelshein 2018) in the input's dtype: float64 stays float64. A device saves for backward only
its queries, keys, values, output and log-sum-exp, never a score matrix (each block's scores are made, used and
freed, in the forward and again in the backward). Keys and values stay compact: grouped-query attention's
``h_kv`` heads, not expanded to the query heads. Masks are rebuilt per block from the tokens' facts.

A block whose mask is made of whole chunks (one document, no padding, each chunk's positions consecutive, no
sliding window that binds: every pair of a query chunk and a key chunk then sees all, the causal triangle, or
nothing) is computed by torch's fused kernels, which return the log-sum-exp the merge needs, and differentiated by
their backward kernels from the merged output and log-sum-exp (as torch's own context parallelism does): flash
attention for the CPU in float32 and float64, memory-efficient attention on CUDA. Any other block, and any other
dtype or device, is computed by matrix products.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
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


#: A pair of a query chunk and a key chunk for the fused kernel: (query rows, key rows, causal triangle or not).
ChunkPair = tuple[slice, slice, bool]
#: The dtypes each device's fused kernel is used for.
_FUSED = {"cpu": (torch.float32, torch.float64), "cuda": (torch.float32, torch.float16, torch.bfloat16)}


def fused_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(output, log-sum-exp)`` of one chunk pair by the device's fused kernel (``[b, h, t, d]``, heads alike)."""
    if query.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, causal, scale=scale)
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, None, True, 0.0, causal, scale=scale
    )
    return out, lse[..., : query.shape[2]]


def fused_backward(
    dout: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of one chunk pair's query, key and value by the device's fused backward kernel, from the
    merged ``out`` and ``lse``."""
    if query.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, query, key, value, out, lse, 0.0, causal, scale=scale
        )
    seed = torch.zeros((), dtype=torch.int64)  # the kernel reads its (unused: no dropout) philox state on the host
    # The kernel takes its tensors laid out as its forward made them: [b, t, h, d] in memory.
    dout, query, key, value, out = (
        x.transpose(1, 2).contiguous().transpose(1, 2) for x in (dout, query, key, value, out)
    )
    # ... and its log-sum-exp padded to a multiple of 32 tokens, as its forward returns it.
    padded = lse.new_zeros((*lse.shape[:-1], -(-lse.shape[-1] // 32) * 32), dtype=torch.float32)
    padded[..., : lse.shape[-1]] = lse
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, query, key, value, None, out, padded, seed, seed, 0.0, [True, True, True, False], causal, scale=scale
    )
    return dq, dk, dv


def chunk_pairs(queries: TokenFacts, keys: TokenFacts, masking: Masking, query: torch.Tensor) -> list[ChunkPair] | None:
    """The pairs of chunks (two halves of the queries, two of the keys) the fused kernel computes for this block,
    leaving out those that see nothing; None when the block's mask is not made of whole chunks or the kernel does
    not apply (then it is computed by matrix products)."""
    if query.dtype not in _FUSED.get(query.device.type, ()):
        return None
    t, s = queries.positions.shape[1], keys.positions.shape[1]
    if t != s or t % 2:
        return None
    if not (bool(queries.valid.all()) and bool(keys.valid.all())):
        return None
    document = queries.documents[0, 0]
    if not (bool((queries.documents == document).all()) and bool((keys.documents == document).all())):
        return None
    starts = []
    half = t // 2
    step = torch.arange(half, device=queries.positions.device)
    for facts in (queries, keys):
        positions = facts.positions
        if not bool((positions == positions[:1]).all()):
            return None
        row = positions[0]
        for first in (0, half):
            if not torch.equal(row[first : first + half], row[first] + step):
                return None
        starts.append((int(row[0]), int(row[half])))
    reach = max(starts[0]) + half - min(starts[1])
    if masking.window is not None and masking.window < reach:
        return None
    pairs = []
    for qi, a in enumerate(starts[0]):
        for kj, b in enumerate(starts[1]):
            rows, columns = slice(qi * half, (qi + 1) * half), slice(kj * half, (kj + 1) * half)
            if not masking.causal or b + half - 1 <= a:
                pairs.append((rows, columns, False))
            elif b == a:
                pairs.append((rows, columns, True))
            elif b <= a + half - 1:
                return None  # chunks that overlap without lining up
    return pairs


def _expanded(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """Keys or values ``[b, h_kv, s, d]`` repeated for the ``heads`` query heads (grouped-query attention)."""
    groups = heads // tensor.shape[1]
    return tensor if groups == 1 else tensor.repeat_interleave(groups, dim=1)


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``[b, h_kv, g, t_q, t_k]`` scaled scores, masked entries ``-inf``."""
    scores = torch.einsum("bkgqd,bksd->bkgqs", q, k) * scale
    return scores.masked_fill(~mask[:, None, None], float("-inf"))


class OnlineSoftmax:
    """Attention of queries ``q`` ``[b, h_kv, g, t, d]`` over blocks of keys added one by one: the running max, sum
    of exponentials and unnormalised output, in the input's dtype."""

    def __init__(self, q: torch.Tensor) -> None:
        # float64 and float32 merge in their own dtype; 16-bit inputs in float32, as torch's merge does.
        dtype = q.dtype if q.dtype in (torch.float64, torch.float32) else torch.float32
        self.running_max = q.new_full(q.shape[:-1], float("-inf"), dtype=dtype)
        self.running_sum = q.new_zeros(q.shape[:-1], dtype=dtype)
        self.output = torch.zeros_like(q, dtype=dtype)

    def add(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> None:
        """Take in one block of keys and values (``[b, h_kv, s, d]``) under ``mask`` ``[b, t, s]``."""
        scores = _scores(q, k, mask, scale)
        new_max = torch.maximum(self.running_max, scores.amax(-1))
        safe = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
        weights = torch.exp(scores - safe[..., None])
        rescale = torch.exp(self.running_max - safe)
        self.running_sum = self.running_sum * rescale + weights.sum(-1)
        self.output = self.output * rescale[..., None] + torch.einsum("bkgqs,bksd->bkgqd", weights, v.to(weights.dtype))
        self.running_max = new_max

    def add_fused(
        self, query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pairs: list[ChunkPair], scale: float
    ) -> None:
        """Take in one block by the fused kernel, chunk pair by chunk pair (``query`` ``[b, h, t, d]``)."""
        heads = query.shape[1]
        key, value = _expanded(k, heads), _expanded(v, heads)
        for rows, columns, causal in pairs:
            out, lse = fused_forward(
                query[:, :, rows].contiguous(),
                key[:, :, columns].contiguous(),
                value[:, :, columns].contiguous(),
                causal,
                scale,
            )
            out = grouped(out, k.shape[1]).to(self.output.dtype)
            lse = grouped(lse[..., None], k.shape[1])[..., 0].to(self.running_max.dtype)
            old_max = self.running_max[..., rows]
            new_max = torch.maximum(old_max, lse)
            safe = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
            rescale, weight = torch.exp(old_max - safe), torch.exp(lse - safe)
            self.running_sum[..., rows] = self.running_sum[..., rows] * rescale + weight
            self.output[..., rows, :] = self.output[..., rows, :] * rescale[..., None] + out * weight[..., None]
            self.running_max[..., rows] = new_max

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
        # Computed in the merge's dtype (float32 for 16-bit inputs); the fused kernels take the inputs' own.
        self.given = (q, dout)
        self.q, self.dout, self.scale = q.to(lse.dtype), dout.to(lse.dtype), scale
        self.delta = (self.dout * output).sum(-1)  # D = rowsum(dO ∘ O)
        self.empty = torch.isinf(lse)
        self.lse = torch.where(self.empty, torch.zeros_like(lse), lse)
        self.dq = torch.zeros_like(self.q)

    def add(self, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradients of block ``k``, ``v`` (and its share of the queries', kept)."""
        given = k.dtype
        k, v = k.to(self.q.dtype), v.to(self.q.dtype)
        probabilities = torch.exp(_scores(self.q, k, mask, self.scale) - self.lse[..., None])
        probabilities = probabilities.masked_fill(self.empty[..., None], 0.0)
        dv = torch.einsum("bkgqs,bkgqd->bksd", probabilities, self.dout)
        dscores = probabilities * (torch.einsum("bkgqd,bksd->bkgqs", self.dout, v) - self.delta[..., None])
        self.dq = self.dq + torch.einsum("bkgqs,bksd->bkgqd", dscores, k) * self.scale
        return (torch.einsum("bkgqs,bkgqd->bksd", dscores, self.q) * self.scale).to(given), dv.to(given)

    def add_fused(
        self, k: torch.Tensor, v: torch.Tensor, pairs: list[ChunkPair], output: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradients of block ``k``, ``v`` by the fused kernel's backward, chunk pair by chunk pair, from the
        merged ``output`` (grouped, as :meth:`OnlineSoftmax.result` gives it)."""
        b, kv, g, t, d = self.q.shape
        flat = (b, kv * g, t)
        query, dout, out = (x.reshape(*flat, x.shape[-1]) for x in (*self.given, output))
        lse = self.lse.reshape(flat)
        key, value = _expanded(k, kv * g), _expanded(v, kv * g)
        dq, dk, dv = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
        for rows, columns, causal in pairs:
            gq, gk, gv = fused_backward(
                dout[:, :, rows].contiguous(),
                query[:, :, rows].contiguous(),
                key[:, :, columns].contiguous(),
                value[:, :, columns].contiguous(),
                out[:, :, rows].to(query.dtype).contiguous(),
                lse[:, :, rows].contiguous(),
                causal,
                self.scale,
            )
            dq[:, :, rows] += gq
            dk[:, :, columns] += gk
            dv[:, :, columns] += gv
        self.dq = self.dq + dq.reshape(self.q.shape).to(self.dq.dtype)
        if g > 1:  # each key/value head's gradient sums over the query heads that share it
            dk, dv = (x.reshape(b, kv, g, *x.shape[2:]).sum(2) for x in (dk, dv))
        return dk, dv


class _BlockwiseAttention(torch.autograd.Function):
    @staticmethod
    def forward(
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
            pairs = chunk_pairs(queries, keys, masking, query)
            if pairs is None:
                merge.add(q, k, v, masking.between(queries, keys), scale)
            else:
                merge.add_fused(query, k, v, pairs, scale)
        output, lse = merge.result()
        ctx.save_for_backward(query, key, value, output, lse)
        ctx.queries, ctx.blocks, ctx.masking, ctx.scale = queries, blocks, masking, scale
        return output.reshape(query.shape).to(query.dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, output, lse = ctx.saved_tensors
        q = grouped(query, key.shape[1])
        gradients = BlockGradients(q, grouped(grad_output.contiguous(), key.shape[1]), output, lse, ctx.scale)

        def gradients_of(k: torch.Tensor, v: torch.Tensor, keys: TokenFacts) -> tuple[torch.Tensor, torch.Tensor]:
            pairs = chunk_pairs(ctx.queries, keys, ctx.masking, query)
            if pairs is None:
                return gradients.add(k, v, ctx.masking.between(ctx.queries, keys))
            return gradients.add_fused(k, v, pairs, output)

        dk, dv = ctx.blocks.backward(key, value, gradients_of)
        return gradients.dq.reshape(query.shape).to(query.dtype), dk, dv, None, None, None, None


@dataclass(eq=False)
class KeySlices:
    """The whole sequence's keys and values held here, in ``count`` slices (one device's tokens each), so that no
    score matrix of the whole sequence is made; their gradients stay here (Ulysses, and the proof's simulated
    devices)."""

    facts: TokenFacts
    count: int

    def forward(
        self, key: torch.Tensor, value: torch.Tensor
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, TokenFacts]]:
        """Each slice with its tokens' facts."""
        length = key.shape[2] // self.count
        for start in range(0, key.shape[2], length):
            yield key.narrow(2, start, length), value.narrow(2, start, length), self.facts.narrow(start, length)

    def backward(
        self, key: torch.Tensor, value: torch.Tensor, gradients_of: BlockGradientsOf
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slice's gradients, put together."""
        dk, dv = zip(*(gradients_of(k, v, keys) for k, v, keys in self.forward(key, value)), strict=True)
        return torch.cat(dk, 2), torch.cat(dv, 2)
