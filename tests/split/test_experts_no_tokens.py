"""Fused experts under ``epl.split`` when no token reaches one device's experts.

Expert parallelism runs each device's experts on the tokens routed to them, and the inputs' gradients are summed
over the devices backward. A device whose experts got no token computes nothing from its inputs; before the fix its
backward skipped that sum while the other device waited in it (a collective mismatch: qwen2_moe under LoRA 3D).
Here the router always picks experts 0 and 1, which device 0 holds: device 1's experts see no token in any step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.helpers.distributed import run_ranks

STEPS = 3


class OnlyFirstExperts(nn.Module):
    """A token mixer, then transformers' fused Qwen2-MoE experts with routing confined to experts 0 and 1."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import Qwen2MoeConfig
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts

        config = Qwen2MoeConfig(hidden_size=16, moe_intermediate_size=12, num_experts=4, num_experts_per_tok=2)
        self.embed = nn.Linear(8, 16)
        self.router = nn.Linear(16, 4, bias=False)
        self.experts = Qwen2MoeExperts(config)
        self.head = nn.Linear(16, 8)
        self.register_buffer("blocked", torch.tensor([0.0, 0.0, -1e4, -1e4]))
        for weight in (self.experts.gate_up_proj, self.experts.down_proj):
            nn.init.normal_(weight, std=0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x).flatten(0, 1)
        weights, index = torch.topk((self.router(tokens) + self.blocked).softmax(-1), 2)
        return self.head(self.experts(tokens, index, weights)).view_as(x)


def batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(2, 5, 8, generator=generator, dtype=torch.float64) for _ in range(STEPS)]


def mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return ((outputs - targets) ** 2).mean()


def built() -> nn.Module:
    torch.manual_seed(0)
    return OnlyFirstExperts().double()


def train_split() -> dict[str, Any]:
    import epl

    epl.init()
    with epl.split(2):
        model = built()
    engine = epl.parallelize(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=mse)
    losses = [float(engine.step(x, x.flip(-1))) for x in batches()]
    state = {k: v.detach().clone() for k, v in engine.state_dict(full=True)["model"].items()}
    return {"losses": losses, "state": state, "repr": repr(engine.model.experts)}


def test_experts_no_token_reaches_still_join_the_backward() -> None:
    model = built()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x in batches():
        optimizer.zero_grad()
        loss = mse(model(x), x.flip(-1))
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    for rank in run_ranks(train_split, 2, timeout=120):
        assert "experts 0..1 of 4" in rank["repr"] or "experts 2..3 of 4" in rank["repr"]
        torch.testing.assert_close(torch.tensor(rank["losses"]), torch.tensor(losses), rtol=1e-10, atol=1e-12)
        for name, value in model.state_dict().items():
            torch.testing.assert_close(rank["state"][name], value, rtol=1e-10, atol=1e-12, msg=name)
