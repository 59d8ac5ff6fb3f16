"""Top-1 and top-2 routing with a capacity, against a plain loop that routes token by token."""

from __future__ import annotations

import math

import pytest
import torch

from epl.errors import EplError
from epl.nn import Experts, MoE, TopKGate


def route_by_loop(probs: torch.Tensor, k: int, capacity_factor: float, group_size: int) -> set[tuple[int, int, int]]:
    """(token, expert, slot) of every kept choice: per group, all first choices in token order, then second."""
    tokens, experts = probs.shape
    capacity = max(1, math.ceil(k * group_size * capacity_factor / experts))
    kept = set()
    for group in range(tokens // group_size):
        members = range(group * group_size, (group + 1) * group_size)
        filled = [0] * experts
        for choice in range(k):
            for token in members:
                expert = int(probs[token].topk(k).indices[choice])
                if filled[expert] < capacity:
                    kept.add((token, expert, group * capacity + filled[expert]))
                filled[expert] += 1
    return kept


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize(("capacity_factor", "group_size"), [(0.5, 8), (1.0, 16), (2.0, 4), (1.25, None)])
def test_routing_matches_the_loop(k: int, capacity_factor: float, group_size: int | None) -> None:
    torch.manual_seed(0)
    gate = TopKGate(6, 4, k=k, capacity_factor=capacity_factor, group_size=group_size).double()
    tokens = torch.randn(16, 6, dtype=torch.float64)
    routing = gate(tokens)
    probs = torch.softmax(tokens @ gate.weight.t(), dim=-1).detach()
    expected = route_by_loop(probs, k, capacity_factor, group_size or 16)
    got = set(zip(routing.token.tolist(), routing.expert.tolist(), routing.slot.tolist(), strict=True))
    assert got == expected
    assert routing.dropped == 16 * k - len(expected)
    top = probs.topk(k, dim=-1)
    weights = top.values / top.values.sum(-1, keepdim=True) if k == 2 else top.values
    for token, expert, weight in zip(routing.token, routing.expert, routing.weight.detach(), strict=True):
        position = top.indices[token].tolist().index(int(expert))
        assert float(weight) == pytest.approx(float(weights[token, position]), abs=1e-12)


def test_small_capacity_drops_tokens_and_they_pass_as_zero() -> None:
    torch.manual_seed(0)
    gate = TopKGate(6, 4, k=1, capacity_factor=0.25, group_size=16)
    layer = MoE(gate, Experts(4, 6, 8))
    x = torch.randn(16, 6)
    out = layer(x)
    routing = layer.last_routing
    assert routing is not None and routing.dropped == 16 - 4  # one slot per expert
    dropped = sorted(set(range(16)) - set(routing.token.tolist()))
    assert torch.equal(out[dropped], torch.zeros(len(dropped), 6))


def test_moe_layer_equals_each_token_through_its_expert() -> None:
    torch.manual_seed(0)
    experts = Experts(3, 5, 7).double()
    layer = MoE(TopKGate(5, 3, k=2, capacity_factor=4.0), experts).double()
    x = torch.randn(2, 4, 5, dtype=torch.float64)
    out = layer(x)
    routing = layer.last_routing
    assert routing is not None and routing.dropped == 0
    tokens = x.reshape(-1, 5)
    expected = torch.zeros_like(tokens)
    for token, expert, weight in zip(routing.token, routing.expert, routing.weight, strict=True):
        h = torch.relu(tokens[token] @ experts.w_in[expert] + experts.b_in[expert, 0])
        expected[token] += weight * (h @ experts.w_out[expert] + experts.b_out[expert, 0])
    torch.testing.assert_close(out, expected.reshape(x.shape), rtol=1e-12, atol=1e-12)


def test_gate_errors_name_the_problem() -> None:
    with pytest.raises(EplError, match="k=1 or k=2"):
        TopKGate(4, 4, k=3)
    with pytest.raises(EplError, match="not a multiple of the group size"):
        TopKGate(4, 4, group_size=5)(torch.randn(8, 4))
