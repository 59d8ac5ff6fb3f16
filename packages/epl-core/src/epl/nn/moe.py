"""Mixture of experts: a top-k gate with a capacity, the experts, and the layer that joins them.

PyTorch has no MoE layer, so EPL ships one. Put the experts under ``epl.split(n)``
and the gate under ``replicate`` (the manual's MoE recipe): each device then holds
``num_experts / n`` experts, and tokens travel to their expert and back by all-to-all.

Routing follows GShard/Switch: tokens are routed in groups of ``group_size``; each
expert takes at most ``capacity = ceil(k * group_size * capacity_factor / num_experts)``
tokens per group, first choices before second choices, in token order; tokens over
capacity are dropped (their share of the output is zero, so a residual connection
carries them through).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from epl.errors import EplError


@dataclass(frozen=True)
class Routing:
    """Where each kept (token, choice) goes: expert, slot in that expert's buffer, and combine weight."""

    token: torch.Tensor
    expert: torch.Tensor
    slot: torch.Tensor
    weight: torch.Tensor
    #: Slots per expert: capacity per group x number of groups.
    slots: int
    #: (token, choice) pairs dropped because their expert was full.
    dropped: int


class TopKGate(nn.Module):
    """Scores tokens against experts and routes each to its top ``k`` (1: Switch, 2: GShard) within capacity.

    After every call, ``aux_loss`` holds the load-balancing loss
    ``num_experts * sum_e(fraction of tokens whose first choice is e * mean probability of e)``,
    for models that add it to their loss.
    """

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        *,
        k: int = 1,
        capacity_factor: float = 1.0,
        group_size: int | None = None,
    ) -> None:
        super().__init__()
        if k not in (1, 2):
            raise EplError(f"TopKGate routes each token to k=1 or k=2 experts, got k={k}.")
        if k > num_experts:
            raise EplError(f"TopKGate(k={k}) needs at least {k} experts, got {num_experts}.")
        if capacity_factor <= 0:
            raise EplError(f"TopKGate(capacity_factor=...) must be positive, got {capacity_factor}.")
        self.num_experts = num_experts
        self.k = k
        self.capacity_factor = capacity_factor
        self.group_size = group_size
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self.aux_loss: torch.Tensor | None = None

    def capacity(self, group_size: int) -> int:
        """Tokens each expert takes from one group of ``group_size`` tokens."""
        return max(1, math.ceil(self.k * group_size * self.capacity_factor / self.num_experts))

    def forward(self, tokens: torch.Tensor) -> Routing:
        """Route ``tokens`` [T, d_model]."""
        count = tokens.shape[0]
        size = self.group_size or count
        if count % size:
            raise EplError(
                f"TopKGate(group_size={size}) got {count} tokens, not a multiple of the group size. "
                "Use a batch whose token count is a multiple of group_size."
            )
        probs = torch.softmax(F.linear(tokens, self.weight), dim=-1)
        top_probs, top_experts = probs.topk(self.k, dim=-1)  # [T, k]
        if self.k == 2:
            top_probs = top_probs / top_probs.sum(dim=-1, keepdim=True)
        first = F.one_hot(top_experts[:, 0], self.num_experts).to(probs.dtype)
        self.aux_loss = self.num_experts * (first.mean(dim=0) * probs.mean(dim=0)).sum()
        capacity = self.capacity(size)
        groups = count // size
        # Position of each (token, choice) in its expert's queue within its group: choices in order, tokens in order.
        choice_major = top_experts.t().reshape(self.k, groups, size).permute(1, 0, 2).reshape(groups, -1)
        onehot = F.one_hot(choice_major, self.num_experts)  # [G, k*S, E]
        position = ((onehot.cumsum(dim=1) - 1) * onehot).sum(dim=-1)  # [G, k*S]
        position = position.reshape(groups, self.k, size).permute(1, 0, 2).reshape(self.k, count).t()  # [T, k]
        kept = position < capacity
        group_of = torch.arange(count, device=tokens.device) // size
        token = torch.arange(count, device=tokens.device).unsqueeze(1).expand(count, self.k)
        slot = group_of.unsqueeze(1) * capacity + position
        return Routing(
            token=token[kept],
            expert=top_experts[kept],
            slot=slot[kept],
            weight=top_probs[kept],
            slots=groups * capacity,
            dropped=int((~kept).sum()),
        )

    def extra_repr(self) -> str:
        """What ``print(model)`` shows of this layer."""
        return (
            f"experts={self.num_experts}, k={self.k}, capacity_factor={self.capacity_factor}, "
            f"group_size={self.group_size}"
        )


class Experts(nn.Module):
    """``num_experts`` two-layer feed-forward networks, weights stacked with the expert first.

    Takes and returns the dispatched tokens [num_experts, slots, d_model]. Under
    ``epl.split(n)`` each device holds ``num_experts / n`` of them (expert parallel).
    """

    def __init__(self, num_experts: int, d_model: int, d_hidden: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w_in = nn.Parameter(torch.empty(num_experts, d_model, d_hidden))
        self.b_in = nn.Parameter(torch.zeros(num_experts, 1, d_hidden))
        self.w_out = nn.Parameter(torch.empty(num_experts, d_hidden, d_model))
        self.b_out = nn.Parameter(torch.zeros(num_experts, 1, d_model))
        for weight, fan_in in ((self.w_in, d_model), (self.w_out, d_hidden)):
            nn.init.uniform_(weight, -(fan_in**-0.5), fan_in**-0.5)

    def forward(self, dispatched: torch.Tensor) -> torch.Tensor:
        """Run every expert's tokens [experts, slots, d_model] through that expert."""
        return expert_feed_forward(dispatched, self.w_in, self.b_in, self.w_out, self.b_out)


def expert_feed_forward(
    tokens: torch.Tensor, w_in: torch.Tensor, b_in: torch.Tensor, w_out: torch.Tensor, b_out: torch.Tensor
) -> torch.Tensor:
    """``relu(tokens @ w_in + b_in) @ w_out + b_out``, batched over the experts (dimension 0)."""
    return torch.baddbmm(b_out, torch.relu(torch.baddbmm(b_in, tokens, w_in)), w_out)


class MoE(nn.Module):
    """A mixture-of-experts layer: route tokens with ``gate``, run them through ``experts``, combine.

    Input and output are [..., d_model]. A dropped token's output is zero.
    """

    def __init__(self, gate: TopKGate, experts: nn.Module) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        #: The routing of the last call (for inspection and tests).
        self.last_routing: Routing | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Every token's weighted sum of its experts' outputs."""
        tokens = x.reshape(-1, x.shape[-1])
        routing = self.gate(tokens)
        self.last_routing = routing
        dispatched = tokens.new_zeros(self.gate.num_experts, routing.slots, tokens.shape[-1])
        dispatched = dispatched.index_put((routing.expert, routing.slot), tokens[routing.token])
        processed = self.experts(dispatched)
        picked = processed[routing.expert, routing.slot] * routing.weight.unsqueeze(-1)
        combined = tokens.new_zeros(tokens.shape).index_add(0, routing.token, picked)
        return combined.reshape(x.shape)
