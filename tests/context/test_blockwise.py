"""The blockwise attention's fused path in one process: which blocks go to torch's fused kernels (whole chunks: all
seen, the causal triangle, or nothing) and which by matrix products; both equal attention over the whole sequence,
outputs and the gradients of queries, keys and values: float64 on the CPU within 1e-12, and on CUDA (the GPU suite)
float32 within 1e-5 and bfloat16 within bfloat16's rounding."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from epl.context import blockwise
from epl.context.chunks import local_positions, shard_sequence
from epl.context.masks import Masking, TokenFacts

BATCH, HEADS, KV_HEADS, SEQUENCE, DIM, DEVICES = 2, 4, 2, 16, 8, 2


class _Devices:
    """Every simulated device's keys and values, this device's first; backward keeps this device's gradients and
    records the others'."""

    def __init__(self, blocks: list[tuple[torch.Tensor, torch.Tensor, TokenFacts]]) -> None:
        self.blocks = blocks
        self.gradients: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(
        self, key: torch.Tensor, value: torch.Tensor
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, TokenFacts]]:
        yield from self.blocks

    def backward(self, key: torch.Tensor, value: torch.Tensor, gradients_of: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.gradients = [gradients_of(k, v, facts) for k, v, facts in self.blocks]
        return self.gradients[0]


def facts_of(device: int) -> TokenFacts:
    return TokenFacts.of(local_positions(SEQUENCE, device, DEVICES)[None].expand(BATCH, -1))


def test_whole_chunks_go_to_the_fused_kernel_and_other_masks_do_not() -> None:
    query = torch.zeros(BATCH, HEADS, SEQUENCE // DEVICES, DIM, dtype=torch.float64)
    half = SEQUENCE // DEVICES // 2
    first, second = slice(0, half), slice(half, 2 * half)
    # Device 0 holds chunks 0 and 3, device 1 chunks 1 and 2 (of 4 chunks of 4 tokens).
    assert blockwise.chunk_pairs(facts_of(0), facts_of(0), Masking(), query) == [
        (first, first, True), (second, first, False), (second, second, True)]  # fmt: skip
    assert blockwise.chunk_pairs(facts_of(0), facts_of(1), Masking(), query) == [
        (second, first, False), (second, second, False)]  # fmt: skip
    assert len(blockwise.chunk_pairs(facts_of(0), facts_of(1), Masking(causal=False), query) or []) == 4
    assert blockwise.chunk_pairs(facts_of(0), facts_of(1), Masking(window=SEQUENCE), query) is not None
    assert blockwise.chunk_pairs(facts_of(0), facts_of(1), Masking(window=3), query) is None  # the window binds
    padded = TokenFacts.of(facts_of(1).positions, valid=facts_of(1).positions < 10)
    assert blockwise.chunk_pairs(facts_of(0), padded, Masking(), query) is None
    packed = TokenFacts.of(facts_of(1).positions, documents=(facts_of(1).positions >= 8).long())
    assert blockwise.chunk_pairs(facts_of(0), packed, Masking(), query) is None
    assert blockwise.chunk_pairs(facts_of(0), facts_of(0), Masking(), query.half()) is None  # not on the CPU


def attend_everywhere(dtype: torch.dtype, device: str, masking: Masking) -> tuple[list[torch.Tensor], list[Any]]:
    """(whole-sequence reference: output, dq, dk, dv) and, per simulated device, the same pieces of its run."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(BATCH, n, SEQUENCE, DIM, generator=generator, dtype=torch.float64).to(device, dtype)
               for n in (HEADS, KV_HEADS, KV_HEADS))  # fmt: skip
    grad = torch.randn(BATCH, HEADS, SEQUENCE, DIM, generator=generator, dtype=torch.float64).to(device, dtype)
    positions = torch.arange(SEQUENCE, device=device)
    mask = positions[None] <= positions[:, None] if masking.causal else torch.ones(SEQUENCE, SEQUENCE, dtype=torch.bool)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*whole, attn_mask=mask.to(device), enable_gqa=True)
    out.backward(grad)
    reference = [out.detach(), *(t.grad for t in whole)]
    runs = []
    for me in range(DEVICES):
        mine = [shard_sequence(t, 2, r, DEVICES).clone().requires_grad_() for r in range(DEVICES) for t in (k, v)]
        order = [me] + [r for r in range(DEVICES) if r != me]
        blocks = _Devices([(mine[2 * r], mine[2 * r + 1], _on(facts_of(r), device)) for r in order])
        query = shard_sequence(q, 2, me, DEVICES).clone().requires_grad_()
        output = blockwise.blockwise_attention(query, mine[2 * me], mine[2 * me + 1], _on(facts_of(me), device),
                                               blocks, masking, DIM**-0.5)  # fmt: skip
        output.backward(shard_sequence(grad, 2, me, DEVICES))
        runs.append((me, output.detach(), query.grad, blocks.gradients, order))
    return reference, runs


def _on(facts: TokenFacts, device: str) -> TokenFacts:
    return TokenFacts(*(t.to(device) for t in (facts.positions, facts.documents, facts.valid)))


def check(dtype: torch.dtype, device: str, masking: Masking, tolerance: float) -> None:
    reference, runs = attend_everywhere(dtype, device, masking)
    out, dq, dk, dv = (t.double() for t in reference)
    key_gradients = {r: [torch.zeros_like(shard_sequence(dk, 2, r, DEVICES))] * 2 for r in range(DEVICES)}
    for me, output, query_gradient, gradients, order in runs:
        torch.testing.assert_close(output.double(), shard_sequence(out, 2, me, DEVICES), rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(query_gradient.double(), shard_sequence(dq, 2, me, DEVICES), rtol=tolerance,
                                   atol=tolerance)  # fmt: skip
        for owner, (gk, gv) in zip(order, gradients, strict=True):
            key_gradients[owner] = [key_gradients[owner][0] + gk.double(), key_gradients[owner][1] + gv.double()]
    for owner, (gk, gv) in key_gradients.items():
        torch.testing.assert_close(gk, shard_sequence(dk, 2, owner, DEVICES), rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(gv, shard_sequence(dv, 2, owner, DEVICES), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("causal", [True, False])
def test_the_fused_path_equals_attention_over_the_whole_sequence_on_the_cpu(causal: bool) -> None:
    check(torch.float64, "cpu", Masking(causal=causal), 1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_the_fused_path_equals_attention_over_the_whole_sequence_on_cuda(dtype: torch.dtype, tolerance: float) -> None:
    check(dtype, "cuda", Masking(), tolerance)
