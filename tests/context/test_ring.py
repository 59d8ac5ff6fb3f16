"""Context-parallel attention on 2 and 4 real processes (gloo), float64, in each mode (ring, all-gather, Ulysses),
against attention over the whole sequence in one process: outputs and the gradients of queries, keys and values
within 1e-12, for causal, right-padded and packed-document batches, a sliding window, bidirectional attention,
and grouped-query attention (causal, bidirectional and windowed also with facts made on the host: the fused kernels,
one call per block); keys and values travel compact: the ring's and the all-gather's forward send
2(c-1)/c·b·s·h_kv·d elements."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from epl.context.chunks import local_facts, local_positions, shard_sequence
from epl.context.masks import TokenFacts, allowed, documents_from_positions
from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.multiprocess

BATCH, HEADS, KV_HEADS, SEQUENCE, DIM = 2, 8, 4, 16, 8
MODES = ["ring", "allgather", "ulysses"]
CASES = {
    "causal": {"causal": True},
    "right-padded": {"causal": True, "padded": True},
    "packed documents": {"causal": True, "packed": True},
    "sliding window": {"causal": True, "window": 3},
    "bidirectional": {"causal": False, "padded": True},
    # Facts made on the host (no position_ids, no padding): the fused kernels compute every block.
    "causal, fused": {"causal": True, "fused": True},
    "bidirectional, fused": {"causal": False, "fused": True},
    "sliding window, fused": {"causal": True, "window": 5, "fused": True},  # pairs the window cuts: exact
}


def inputs(case: dict[str, Any]) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    positions = torch.arange(SEQUENCE).repeat(BATCH, 1)
    if case.get("packed"):  # documents of 5, 7 and 4 tokens, then 9 and 7
        positions = torch.cat([torch.cat([torch.arange(5), torch.arange(7), torch.arange(4)])[None],
                               torch.cat([torch.arange(9), torch.arange(7)])[None]])  # fmt: skip
    valid = torch.ones(BATCH, SEQUENCE, dtype=torch.bool)
    if case.get("padded"):
        valid[1, 11:] = False
    return {
        "q": randn(BATCH, HEADS, SEQUENCE, DIM), "k": randn(BATCH, KV_HEADS, SEQUENCE, DIM),
        "v": randn(BATCH, KV_HEADS, SEQUENCE, DIM), "grad": randn(BATCH, HEADS, SEQUENCE, DIM),
        "positions": positions, "valid": valid,
    }  # fmt: skip


def facts_of(data: dict[str, torch.Tensor]) -> TokenFacts:
    return TokenFacts.of(data["positions"], documents_from_positions(data["positions"]), data["valid"])


def whole_attention(case: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Attention over the whole sequence in one process (keys and values expanded to every head)."""
    data = inputs(case)
    q, k, v = (data[n].clone().requires_grad_() for n in ("q", "k", "v"))
    facts = facts_of(data)
    mask = allowed(facts, facts, causal=case["causal"], window=case.get("window"))[:, None]
    expand = HEADS // KV_HEADS
    scores = q @ k.repeat_interleave(expand, 1).transpose(-1, -2) * DIM**-0.5
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0)
    out = weights @ v.repeat_interleave(expand, 1)
    out.backward(data["grad"])
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def ring_rank(names: list[str]) -> dict[str, Any]:
    from epl.context import kernels
    from epl.context.allgather import allgather_attention
    from epl.context.ring import ContextGroup, Masking, ring_attention
    from epl.context.ulysses import ulysses_attention
    from epl.interfaces.cluster import Cluster
    from epl_comm.torch_communicator import TorchCommunicator

    fused_calls: list[bool] = []
    forward = kernels.forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        fused_calls.append(True)
        return forward(*args, **kwargs)

    kernels.forward = counted  # type: ignore[assignment]  # this rank's own process
    cluster = Cluster.from_environ()
    group = ContextGroup(TorchCommunicator.join(cluster, timeout=60))
    attention = {"ring": ring_attention, "allgather": allgather_attention, "ulysses": ulysses_attention}
    results = {}
    for mode, name in ((mode, name) for mode in MODES for name in names):
        case = CASES[name]
        data = inputs(case)
        mine = {n: shard_sequence(data[n], 2, group.index, group.count) for n in ("q", "k", "v", "grad")}
        facts = facts_of(data)
        local = TokenFacts(*(shard_sequence(t, 1, group.index, group.count) for t in
                             (facts.positions, facts.documents, facts.valid)))  # fmt: skip
        if case.get("fused"):
            local = local_facts(BATCH, SEQUENCE, group.index, group.count)
        q, k, v = (mine[n].clone().requires_grad_() for n in ("q", "k", "v"))
        group.collectives.clear()
        calls = len(fused_calls)
        out = attention[mode](q, k, v, local, group, masking=Masking(case["causal"], case.get("window")))
        forward_sent = group.collectives["send_elements"]
        out.backward(mine["grad"])
        results[mode, name] = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
                               "forward_sent": forward_sent, "fused_calls": len(fused_calls) - calls}  # fmt: skip
    return results


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    return request.param, run_ranks(ring_rank, request.param, list(CASES), timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_context_attention_equals_attention_over_the_whole_sequence(
    ranks: tuple[int, list[dict[str, Any]]], mode: str, name: str
) -> None:
    count, results = ranks
    expected = whole_attention(CASES[name])
    for index, result in enumerate(results):
        got = result[mode, name]
        for key, dim in (("out", 2), ("dq", 2), ("dk", 2), ("dv", 2)):
            torch.testing.assert_close(got[key], shard_sequence(expected[key], dim, index, count), rtol=0, atol=1e-12)


@pytest.mark.timeout(300)
def test_facts_made_on_the_host_go_to_the_fused_kernels(ranks: tuple[int, list[dict[str, Any]]]) -> None:
    """One call per block under the load balance (a device's own block: the triangle), none for the masks the
    kernels do not take (padding, packed documents, a window that cuts a block)."""
    count, results = ranks
    for result in results:
        for mode in ("ring", "allgather"):
            assert result[mode, "causal, fused"]["fused_calls"] == count
            assert result[mode, "bidirectional, fused"]["fused_calls"] == count
            for name in ("right-padded", "packed documents", "sliding window", "bidirectional"):
                assert result[mode, name]["fused_calls"] == 0


@pytest.mark.timeout(300)
def test_keys_and_values_travel_compact(ranks: tuple[int, list[dict[str, Any]]]) -> None:
    count, results = ranks
    expected = 2 * (count - 1) / count * BATCH * SEQUENCE * KV_HEADS * DIM
    for result in results:
        assert result["ring", "causal"]["forward_sent"] == expected
        assert result["allgather", "causal"]["forward_sent"] == expected


def test_local_positions_follow_the_load_balance() -> None:
    assert local_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert local_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
