"""Exact attention a block of keys at a time: partial results merged by log-sum-exp, FlashAttention's backward.

The queries stay on their device; the keys and values come in blocks from a :class:`KeyBlocks`, which also says
where each block's gradients go: round a ring (:mod:`epl.context.ring`), reduce-scattered to their owners
(:mod:`epl.context.allgather`), or kept (:mod:`epl.context.ulysses`). Each block gives an output and the
log-sum-exp of its scores; they merge as the online softmax does (Milakov & Gimelshein 2018), in float32 for
16-bit inputs and in the input's dtype otherwise (float64 stays float64). A device saves for backward only its
queries, keys, values, output and log-sum-exp, never a score matrix. Keys and values stay compact: grouped-query
attention's ``h_kv`` heads, never expanded here.

A block whose tokens' runs are known on the host is planned pair by pair (:mod:`epl.context.pairs`, without
reading a device tensor) and computed by torch's fused kernels (:mod:`epl.context.kernels`), in as few calls as its
mask allows (one for a device's own block: the causal triangle; one for another device's under the causal load
balance), and differentiated by their backward kernels from the merged output and log-sum-exp, as torch's own
context parallelism does; a pair that a sliding window cuts is computed exactly. The plan is made once, in the
forward, and kept for the backward. A block whose runs are not known (padding, packed documents, facts made from
tensors) is computed exactly by matrix products under the mask rebuilt from the tokens' facts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from epl.context import kernels, pairs
from epl.context.masks import Masking, Runs, TokenFacts

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


def merge_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial results merge in: float64 and float32 their own, 16-bit ones float32 (as torch's)."""
    return dtype if dtype in (torch.float64, torch.float32) else torch.float32


class Plans:
    """Each block's plan (:func:`epl.context.pairs.plan`), made on the host in the forward and kept for the
    backward, by the block's runs."""

    def __init__(self, queries: TokenFacts, masking: Masking, fused: bool) -> None:
        self.queries, self.masking, self.fused = queries.runs, masking, fused
        self.made: dict[Runs, pairs.Plan] = {}
        #: What each call's forward kernel handed its backward, by the block's runs (a state per call).
        self.states: dict[Runs, list[kernels.State]] = {}

    def of(self, keys: TokenFacts) -> pairs.Plan:
        """The fused-kernel calls for a block of keys with these facts; None: the exact path."""
        if not self.fused or keys.runs is None:
            return None
        if keys.runs not in self.made:
            self.made[keys.runs] = pairs.plan(self.queries, keys.runs, self.masking)
        return self.made[keys.runs]


class Merge:
    """The output ``[b, h, t, d]`` and log-sum-exp ``[b, h, t]`` of queries over the blocks added so far."""

    def __init__(self, query: torch.Tensor) -> None:
        self.shape, self.dtype, self.device = query.shape, merge_dtype(query.dtype), query.device
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None
        #: Whether ``out`` and ``lse`` are the merge's own, to write in place (not a kernel's results, which
        #: selective checkpointing may keep: torch refuses a kept tensor written after).
        self.owned = False

    def add(self, rows: slice, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Take in one partial result of query ``rows`` (``lse`` ``-inf`` where a query saw nothing)."""
        if self.out is None and rows == slice(0, self.shape[2]):
            self.out, self.lse = out, lse  # the first result of every query: kept as it is
            return
        if self.out is None or self.lse is None:
            self.out = torch.zeros(self.shape, dtype=self.dtype, device=out.device)
            self.lse = torch.full(self.shape[:-1], float("-inf"), dtype=self.dtype, device=out.device)
        elif not self.owned:  # a second result: the kept first one is copied once, then merged into
            self.out, self.lse = self.out.to(self.dtype, copy=True), self.lse.to(self.dtype, copy=True)
        self.owned = True
        old_out, old_lse = self.out[:, :, rows], self.lse[:, :, rows]
        lse = lse.to(self.dtype)
        new_lse = torch.logaddexp(old_lse, lse)
        safe = torch.where(torch.isinf(new_lse), torch.zeros_like(new_lse), new_lse)
        old_weight, weight = torch.exp(old_lse - safe)[..., None], torch.exp(lse - safe)[..., None]
        self.out[:, :, rows] = old_out * old_weight + out.to(self.dtype) * weight
        self.lse[:, :, rows] = new_lse

    def result(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The output in ``dtype`` and the log-sum-exp (``-inf`` for a query that saw nothing, whose output is 0)."""
        if self.out is None or self.lse is None:
            out = torch.zeros(self.shape, dtype=dtype, device=self.device)
            return out, torch.full(self.shape[:-1], float("-inf"), dtype=self.dtype, device=self.device)
        return self.out.to(dtype), self.lse.to(self.dtype)


def exact_block(
    query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(output, log-sum-exp)`` of ``query`` ``[b, h, t, d]`` over one block ``[b, h_kv, s, d]`` under ``mask``
    ``[b, t, s]``, by matrix products in the merge's dtype."""
    dtype = merge_dtype(query.dtype)
    q = grouped(query, k.shape[1]).to(dtype)
    scores = _scores(q, k.to(dtype), mask, scale)
    lse = torch.logsumexp(scores, -1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    out = torch.einsum("bkgqs,bksd->bkgqd", torch.exp(scores - safe[..., None]), v.to(dtype))
    return out.reshape(query.shape), lse.reshape(query.shape[:-1])


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``[b, h_kv, g, t_q, t_k]`` scaled scores, masked entries ``-inf``."""
    scores = torch.einsum("bkgqd,bksd->bkgqs", q, k) * scale
    return scores.masked_fill(~mask[:, None, None], float("-inf"))


#: The mask ``[b, rows, columns]`` of some rows and columns of a block.
MaskOf = Callable[[slice, slice], torch.Tensor]


def mask_of(queries: TokenFacts, keys: TokenFacts, masking: Masking) -> MaskOf:
    """The mask of any rows and columns of the block of ``queries`` against ``keys``."""

    def mask(rows: slice, columns: slice) -> torch.Tensor:
        return masking.between(
            queries.narrow(rows.start, rows.stop - rows.start), keys.narrow(columns.start, columns.stop - columns.start)
        )

    return mask


def planned_block(
    query: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    calls: tuple[pairs.Call, ...],
    scale: float,
    merge: Merge,
    mask: MaskOf,
) -> list[kernels.State]:
    """Add one block to ``merge``, a fused-kernel call per :class:`~epl.context.pairs.Call` (a masked one by
    matrix products); returns what each call's kernel hands its backward."""
    states: list[kernels.State] = []
    for call in calls:
        rows, columns = query[:, :, call.rows], (k[:, :, call.columns], v[:, :, call.columns])
        state: kernels.State = ()
        if call.masked:
            out, lse = exact_block(rows, *columns, mask(call.rows, call.columns), scale)
        else:
            out, lse, state = kernels.forward(rows, *columns, call.causal, scale)
        merge.add(call.rows, out, lse)
        states.append(state)
    return states


class Gradients:
    """The backward pass, block by block, from the final output and log-sum-exp (as FlashAttention's): accumulates
    the queries' gradient, returns each block's keys' and values' gradients."""

    def __init__(
        self, query: torch.Tensor, dout: torch.Tensor, output: torch.Tensor, lse: torch.Tensor, scale: float
    ) -> None:
        self.query, self.dout, self.output, self.lse, self.scale = query, dout, output, lse, scale
        self.dq: torch.Tensor | None = None
        self._grouped: dict[int, tuple[torch.Tensor, ...]] = {}

    def _add_dq(self, rows: slice, dq: torch.Tensor) -> None:
        if self.dq is None and rows == slice(0, self.query.shape[2]):
            self.dq = dq
            return
        if self.dq is None:
            self.dq = torch.zeros(self.query.shape, dtype=self.lse.dtype, device=dq.device)
        self.dq = self.dq.to(self.lse.dtype)
        self.dq[:, :, rows] += dq.to(self.dq.dtype)

    def query_gradient(self) -> torch.Tensor:
        """The queries' gradient over every block added, in their dtype."""
        return torch.zeros_like(self.query) if self.dq is None else self.dq.to(self.query.dtype)

    def planned(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        calls: tuple[pairs.Call, ...],
        mask: MaskOf,
        states: list[kernels.State],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradients of block ``k``, ``v`` by the fused kernel's backward, a call per ``calls`` (a masked one
        by matrix products), given what each call's forward kernel handed on."""
        dk: torch.Tensor | None = None
        dv: torch.Tensor | None = None
        for call, state in zip(calls, states or [()] * len(calls), strict=True):
            rows, columns = call.rows, call.columns
            if call.masked:
                gk, gv = self.exact(k[:, :, columns], v[:, :, columns], mask(rows, columns), rows)
            else:
                gq, gk, gv = kernels.backward(
                    self.dout[:, :, rows], self.query[:, :, rows], k[:, :, columns], v[:, :, columns],
                    self.output[:, :, rows], self.lse[:, :, rows].contiguous(), call.causal, self.scale,
                    state,
                )  # fmt: skip
                self._add_dq(rows, gq)
            if len(calls) == 1 and columns == slice(0, k.shape[2]):
                dk, dv = gk, gv
                continue
            if dk is None or dv is None:
                dk = torch.zeros(k.shape, dtype=self.lse.dtype, device=k.device)
                dv = torch.zeros(v.shape, dtype=self.lse.dtype, device=v.device)
            dk[:, :, columns] += gk.to(dk.dtype)
            dv[:, :, columns] += gv.to(dv.dtype)
        if dk is None or dv is None:
            return torch.zeros_like(k), torch.zeros_like(v)
        return dk.to(k.dtype), dv.to(v.dtype)

    def grouped_inputs(self, kv_heads: int) -> tuple[torch.Tensor, ...]:
        """Queries, output gradient and ``D = rowsum(dO ∘ O)`` grouped ``[b, h_kv, g, t, ...]`` in the merge's
        dtype, the log-sum-exp with ``-inf`` (queries that saw nothing) made 0, and where it was (for
        :meth:`exact`; made once)."""
        if kv_heads not in self._grouped:
            dtype = self.lse.dtype
            q, dout = grouped(self.query.to(dtype), kv_heads), grouped(self.dout.to(dtype), kv_heads)
            delta = (dout * grouped(self.output.to(dtype), kv_heads)).sum(-1)
            lse = grouped(self.lse[..., None], kv_heads)[..., 0]
            empty = torch.isinf(lse)
            self._grouped[kv_heads] = (q, dout, delta, torch.where(empty, torch.zeros_like(lse), lse), empty)
        return self._grouped[kv_heads]

    def exact(
        self, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, rows: slice | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradients of block ``k``, ``v`` by matrix products under ``mask`` (and its share of the gradient
        of the queries' ``rows``, all by default, kept)."""
        rows = slice(0, self.query.shape[2]) if rows is None else rows
        q, dout, delta, lse, empty = (t[:, :, :, rows] for t in self.grouped_inputs(k.shape[1]))
        given = k.dtype
        k, v = k.to(q.dtype), v.to(q.dtype)
        probabilities = torch.exp(_scores(q, k, mask, self.scale) - lse[..., None])
        probabilities = probabilities.masked_fill(empty[..., None], 0.0)
        dv = torch.einsum("bkgqs,bkgqd->bksd", probabilities, dout)
        dscores = probabilities * (torch.einsum("bkgqd,bksd->bkgqs", dout, v) - delta[..., None])
        dq = torch.einsum("bkgqs,bksd->bkgqd", dscores, k) * self.scale
        self._add_dq(rows, dq.flatten(1, 2))
        return (torch.einsum("bkgqs,bkgqd->bksd", dscores, q) * self.scale).to(given), dv.to(given)


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
        plans = Plans(queries, masking, kernels.supported(query))
        merge = Merge(query)
        for k, v, keys in blocks.forward(key, value):
            calls = plans.of(keys)
            if calls is None:
                merge.add(slice(0, query.shape[2]), *exact_block(query, k, v, masking.between(queries, keys), scale))
            else:
                states = planned_block(query, k, v, calls, scale, merge, mask_of(queries, keys, masking))
                if keys.runs is not None:  # (always, with a plan)
                    plans.states[keys.runs] = states
        output, lse = merge.result(query.dtype)
        ctx.save_for_backward(query, key, value, output, lse)
        ctx.queries, ctx.blocks, ctx.masking, ctx.scale, ctx.plans = queries, blocks, masking, scale, plans
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, output, lse = ctx.saved_tensors
        gradients = Gradients(query, grad_output, output, lse, ctx.scale)

        def gradients_of(k: torch.Tensor, v: torch.Tensor, keys: TokenFacts) -> tuple[torch.Tensor, torch.Tensor]:
            calls = ctx.plans.of(keys)
            if calls is None:
                return gradients.exact(k, v, ctx.masking.between(ctx.queries, keys))
            states = ctx.plans.states.get(keys.runs, [])
            return gradients.planned(k, v, calls, mask_of(ctx.queries, keys, ctx.masking), states)

        dk, dv = ctx.blocks.backward(key, value, gradients_of)
        return gradients.query_gradient(), dk, dv, None, None, None, None


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
