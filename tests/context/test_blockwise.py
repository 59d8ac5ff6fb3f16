"""The blockwise attention in one process, its devices simulated: which blocks go to torch's fused kernels and in
how many calls (told on the host, without reading a device tensor), and which keep the exact masked path; both
equal attention over the whole sequence, outputs and the gradients of queries, keys and values: float64 on the
CPU within 1e-12 (the CPU's flash kernel takes float64), causal, bidirectional, grouped-query attention (4 query
heads over 2), packed documents and a sliding window, over 2 and 4 simulated devices; on CUDA (the GPU suite)
float32 within 1e-5 and bfloat16 within bfloat16's rounding."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from epl.context import blockwise, kernels
from epl.context.chunks import local_facts, shard_sequence
from epl.context.masks import Masking, TokenFacts, allowed, documents_from_positions
from epl.context.pairs import Call, plan

BATCH, HEADS, KV_HEADS, SEQUENCE, DIM = 2, 4, 2, 16, 8


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


def test_the_plan_is_one_call_per_block_under_the_load_balance() -> None:
    # 2 devices: device 0 holds chunks 0 and 3, device 1 chunks 1 and 2 (of 4 chunks of 4 tokens).
    zero, one = local_facts(1, SEQUENCE, 0, 2).runs, local_facts(1, SEQUENCE, 1, 2).runs
    assert zero == ((0, 4), (12, 4)) and one == ((4, 8),)  # chunks 1 and 2 are one run
    whole, first, second = slice(0, 8), slice(0, 4), slice(4, 8)
    assert plan(zero, zero, Masking()) == (Call(whole, whole, True),)  # its own block: the causal triangle
    assert plan(zero, one, Masking()) == (Call(second, whole, False),)  # chunk 3 sees chunks 1 and 2 whole
    assert plan(one, zero, Masking()) == (Call(whole, first, False),)  # chunks 1 and 2 see chunk 0 whole
    assert plan(zero, one, Masking(causal=False)) == (Call(whole, whole, False),)
    assert plan(zero, one, Masking(window=SEQUENCE)) == (Call(second, whole, False),)  # the window does not bind
    # A pair the window cuts is computed exactly, the others still fused: the choice is per pair.
    assert plan(zero, one, Masking(window=3)) == (Call(second, whole, False, masked=True),)
    assert plan(zero, zero, Masking(window=9)) == (Call(first, first, True), Call(second, second, True))
    # Runs that overlap without lining up are cut where the other side's start or end.
    assert plan(((0, 4),), ((2, 4),), Masking()) == (Call(slice(2, 4), slice(0, 2), True),)
    assert plan(((0, 8),), ((0, 4), (4, 4)), Masking()) == (
        Call(first, first, True), Call(second, first, False), Call(second, second, True))  # fmt: skip
    assert plan(((0, 4),), ((8, 4),), Masking()) == ()  # sees nothing: skipped
    assert plan(None, one, Masking()) is None  # runs not known (padding, packed documents)
    # Pairs that make no rectangle: a call each, the triangle causal.
    assert plan(((0, 4), (8, 4)), ((0, 4), (8, 4)), Masking(window=5)) == (
        Call(first, first, True), Call(second, second, True))  # fmt: skip


def test_the_facts_keep_their_runs_through_narrow_and_concatenation() -> None:
    facts = [local_facts(1, SEQUENCE, device, 4) for device in range(4)]
    assert facts[0].runs == ((0, 2), (14, 2))
    everything = TokenFacts.concatenated(facts)
    assert everything.runs == ((0, 2), (14, 2), (2, 2), (12, 2), (4, 2), (10, 2), (6, 4))
    assert everything.narrow(2, 4).runs == ((14, 2), (2, 2))
    assert everything.narrow(2, 4).positions.tolist() == [[14, 15, 2, 3]]
    assert TokenFacts.of(facts[0].positions).runs is None  # made from a tensor: not known


def run_everywhere(
    dtype: torch.dtype,
    device: str,
    masking: Masking,
    devices: int,
    facts_of: Callable[[int], TokenFacts],
    dim: int = DIM,
) -> tuple[list[torch.Tensor], list[Any]]:
    """(whole-sequence reference: output, dq, dk, dv) and, per simulated device, the same pieces of its run."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(BATCH, n, SEQUENCE, dim, generator=generator, dtype=torch.float64).to(device, dtype)
               for n in (HEADS, KV_HEADS, KV_HEADS))  # fmt: skip
    grad = torch.randn(BATCH, HEADS, SEQUENCE, dim, generator=generator, dtype=torch.float64).to(device, dtype)
    whole_facts = _unsharded([facts_of(r) for r in range(devices)])
    mask = allowed(whole_facts, whole_facts, causal=masking.causal, window=masking.window)[:, None]
    whole = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    groups = HEADS // KV_HEADS
    scores = whole[0] @ whole[1].repeat_interleave(groups, 1).transpose(-1, -2) * dim**-0.5
    out = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0) @ whole[2].repeat_interleave(
        groups, 1
    )
    out.backward(grad.double().cpu())
    reference = [out.detach(), *(t.grad for t in whole)]
    runs = []
    for me in range(devices):
        mine = [shard_sequence(t, 2, r, devices).clone().requires_grad_() for r in range(devices) for t in (k, v)]
        order = [me] + [r for r in range(devices) if r != me]
        blocks = _Devices([(mine[2 * r], mine[2 * r + 1], _on(facts_of(r), device)) for r in order])
        query = shard_sequence(q, 2, me, devices).clone().requires_grad_()
        output = blockwise.blockwise_attention(query, mine[2 * me], mine[2 * me + 1], _on(facts_of(me), device),
                                               blocks, masking, dim**-0.5)  # fmt: skip
        output.backward(shard_sequence(grad, 2, me, devices))
        runs.append((me, output.detach(), query.grad, blocks.gradients, order))
    return reference, runs


def _unsharded(facts: list[TokenFacts]) -> TokenFacts:
    from epl.context.chunks import unshard_sequence

    return TokenFacts(
        *(unshard_sequence([getattr(f, n) for f in facts], 1) for n in ("positions", "documents", "valid"))
    )


def _on(facts: TokenFacts, device: str) -> TokenFacts:
    return TokenFacts(*(t.to(device) for t in (facts.positions, facts.documents, facts.valid)), facts.runs)


def check(
    dtype: torch.dtype,
    device: str,
    masking: Masking,
    tolerance: float,
    devices: int = 2,
    facts_of: Callable[[int], TokenFacts] | None = None,
    dim: int = DIM,
) -> None:
    def plain(r: int) -> TokenFacts:
        return local_facts(BATCH, SEQUENCE, r, devices)

    reference, runs = run_everywhere(dtype, device, masking, devices, facts_of or plain, dim)
    out, dq, dk, dv = (t.double() for t in reference)
    key_gradients = {r: [torch.zeros_like(shard_sequence(dk, 2, r, devices))] * 2 for r in range(devices)}
    for me, output, query_gradient, gradients, order in runs:
        close = {"rtol": tolerance, "atol": tolerance}
        torch.testing.assert_close(output.double().cpu(), shard_sequence(out, 2, me, devices), **close)
        torch.testing.assert_close(query_gradient.double().cpu(), shard_sequence(dq, 2, me, devices), **close)
        for owner, (gk, gv) in zip(order, gradients, strict=True):
            key_gradients[owner] = [key_gradients[owner][0] + gk.double().cpu(),
                                    key_gradients[owner][1] + gv.double().cpu()]  # fmt: skip
    for owner, (gk, gv) in key_gradients.items():
        torch.testing.assert_close(gk, shard_sequence(dk, 2, owner, devices), rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(gv, shard_sequence(dv, 2, owner, devices), rtol=tolerance, atol=tolerance)


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, bool]]:
    """Every fused forward call's (queries, keys, causal)."""
    calls: list[tuple[int, int, bool]] = []
    forward = kernels.forward

    def counted(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool, scale: float) -> Any:
        calls.append((query.shape[2], key.shape[2], causal))
        return forward(query, key, value, causal, scale)

    monkeypatch.setattr(kernels, "forward", counted)
    return calls


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_the_fused_path_equals_attention_over_the_whole_sequence_on_the_cpu(
    causal: bool, devices: int, kernel_calls: list[tuple[int, int, bool]]
) -> None:
    check(torch.float64, "cpu", Masking(causal=causal), 1e-12, devices)
    local = SEQUENCE // devices
    if causal:  # per device: its own block (the triangle), then one call per other device's block
        own, others = (local, local, True), {(local // 2, local, False), (local, local // 2, False)}
        for me in range(devices):
            mine = kernel_calls[me * devices : (me + 1) * devices]
            assert mine[0] == own and set(mine[1:]) <= others
    else:
        assert kernel_calls == [(local, local, False)] * devices * devices


@pytest.mark.parametrize("causal", [True, False])
def test_blocks_that_do_not_line_up_are_cut_into_pairs_that_do(
    causal: bool, kernel_calls: list[tuple[int, int, bool]]
) -> None:
    """The whole sequence's queries against 4 slices of its keys (as Ulysses and the proof's devices attend):
    float64 within 1e-12 of ``scaled_dot_product_attention``, 7 calls causal (4 triangles, 3 rectangles), 4 not."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(BATCH, n, SEQUENCE, DIM, generator=generator, dtype=torch.float64, requires_grad=True)
               for n in (HEADS, KV_HEADS, KV_HEADS))  # fmt: skip
    facts = TokenFacts.of_runs(((0, SEQUENCE),), BATCH)
    masking = Masking(causal=causal)
    out = blockwise.blockwise_attention(q, k, v, facts, blockwise.KeySlices(facts, 4), masking, DIM**-0.5)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    grad = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    got, want = (torch.autograd.grad(t, (q, k, v), grad, retain_graph=True) for t in (out, expected))
    for found, wanted in zip(got, want, strict=True):
        torch.testing.assert_close(found, wanted, rtol=0, atol=1e-12)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    assert len(kernel_calls) == (7 if causal else 4)
    # A sum's gradient comes expanded (no strides): the kernels take it as it is.
    got, want = (torch.autograd.grad(t.sum(), (q, k, v)) for t in (out, expected))
    for found, wanted in zip(got, want, strict=True):
        torch.testing.assert_close(found, wanted, rtol=0, atol=1e-12)


def test_the_fused_path_in_float32_within_its_rounding(kernel_calls: list[tuple[int, int, bool]]) -> None:
    check(torch.float32, "cpu", Masking(), 1e-5, 4)
    assert kernel_calls


def test_packed_documents_keep_the_exact_path(kernel_calls: list[tuple[int, int, bool]]) -> None:
    positions = torch.cat([torch.arange(5), torch.arange(7), torch.arange(4)])[None].expand(BATCH, -1)
    packed = TokenFacts.of(positions, documents_from_positions(positions))

    def facts_of(r: int) -> TokenFacts:
        return TokenFacts(*(shard_sequence(t, 1, r, 2) for t in (packed.positions, packed.documents, packed.valid)))

    check(torch.float64, "cpu", Masking(), 1e-12, 2, facts_of)
    assert kernel_calls == []


@pytest.mark.parametrize(("window", "fused"), [(3, False), (9, True), (SEQUENCE, True)])
def test_a_window_that_cuts_a_pair_keeps_the_exact_path_for_that_pair(
    window: int, fused: bool, kernel_calls: list[tuple[int, int, bool]]
) -> None:
    check(torch.float64, "cpu", Masking(window=window), 1e-12, 2)
    assert bool(kernel_calls) == fused


def test_no_device_tensor_is_read_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every way Python reads a tensor's value (which on a GPU waits for it) raises inside the attention."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(BATCH, n, SEQUENCE // 2, DIM, generator=generator, requires_grad=True)
               for n in (HEADS, KV_HEADS, KV_HEADS))  # fmt: skip
    facts = [local_facts(BATCH, SEQUENCE, r, 2) for r in range(2)]
    others = [(torch.randn_like(k), torch.randn_like(v), facts[1])]

    def read(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a tensor was read on the host")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, read)
    monkeypatch.setattr(torch, "equal", read)
    blocks = _Devices([(k, v, facts[0]), *others])
    blockwise.blockwise_attention(q, k, v, facts[0], blocks, Masking(), DIM**-0.5).sum().backward()
    monkeypatch.undo()
    assert q.grad is not None and bool(q.grad.abs().sum() > 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("head_size", [8, 128])
def test_the_fused_path_equals_attention_over_the_whole_sequence_on_cuda(
    dtype: torch.dtype, tolerance: float, head_size: int, kernel_calls: list[tuple[int, int, bool]]
) -> None:
    """float32: the memory-efficient kernel (keys and values expanded for it); bfloat16: FlashAttention 2
    (grouped-query attention as it is); head sizes 8 and 128."""
    check(dtype, "cuda", Masking(), tolerance, 2, dim=head_size)
    check(dtype, "cuda", Masking(causal=False), tolerance, 4, dim=head_size)
    assert kernel_calls


@pytest.mark.parametrize(("dtype", "flash"), [(torch.bfloat16, True), (torch.float32, False)])
def test_the_cuda_calls_fit_the_kernels_schemas_on_the_meta_device(
    dtype: torch.dtype, flash: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a GPU: the CUDA path's arguments fit the ops (their meta kernels check them), grouped-query
    attention's ``h_kv`` heads in and out, on a slice of the rows and columns."""
    monkeypatch.setattr(kernels, "_ampere", lambda device: True)
    q, dout = (torch.empty(2, 8, 64, 128, device="meta", dtype=dtype) for _ in range(2))
    k, v = (torch.empty(2, 2, 64, 128, device="meta", dtype=dtype) for _ in range(2))
    assert kernels._flash(q) == flash
    rows = slice(32, 64)
    out, lse, state = kernels.forward(q[:, :, rows], k, v, False, 0.1)
    assert out.shape == (2, 8, 32, 128) and lse.shape == (2, 8, 32) and len(state) == 2
    dq, dk, dv = kernels.backward(dout[:, :, rows], q[:, :, rows], k, v, out, lse, False, 0.1, state)
    assert dq.shape == (2, 8, 32, 128) and dk.shape == dv.shape == (2, 2, 64, 128)


def test_a_models_batch_is_plain_without_position_ids_or_padding() -> None:
    """The runs a model's batch carries: known without reading a tensor when neither ``position_ids`` nor an
    ``attention_mask`` is given, else read once per forward."""
    from epl.context.transformers_models import _plain

    positions = torch.arange(SEQUENCE).expand(BATCH, -1)
    packed = torch.cat([torch.arange(5), torch.arange(11)]).expand(BATCH, -1)
    padded = torch.ones(BATCH, SEQUENCE, dtype=torch.long)
    padded[1, 12:] = 0
    assert _plain(positions, None, packed=False)
    assert _plain(positions, None, packed=True) and not _plain(packed, None, packed=True)
    assert _plain(positions, torch.ones_like(padded), packed=False) and not _plain(positions, padded, packed=False)
