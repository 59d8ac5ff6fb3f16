"""The split backward (input gradients, then weight gradients) equals one plain backward, exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from epl_pipeline.split_backward import backward_input, backward_weight


class Residual(nn.Module):
    """Two inputs, two outputs, residual paths, a free parameter and a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.pos = nn.Parameter(torch.randn(6))
        self.norm = nn.LayerNorm(6)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + self.a(x).relu() + self.pos
        return self.norm(self.b(h) + h) * z.sum(), h.tanh()


@pytest.mark.parametrize("inputs_need_grad", [True, False])
def test_split_backward_equals_plain_backward(inputs_need_grad: bool) -> None:
    torch.manual_seed(0)
    model = Residual().double()
    x, z = (torch.randn(4, 6, dtype=torch.float64, requires_grad=inputs_need_grad) for _ in range(2))
    grads = [torch.randn(4, 6, dtype=torch.float64) for _ in range(2)]
    torch.autograd.backward(model(x, z), grads)
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    expected_inputs = [x.grad, z.grad]
    model.zero_grad(set_to_none=True)
    fired: list[torch.Tensor] = []
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(fired.append)
    x2, z2 = (t.detach().clone().requires_grad_(inputs_need_grad) for t in (x, z))

    input_grads, pending = backward_input(list(model(x2, z2)), grads, [x2, z2], list(model.parameters()))
    assert all(p.grad is None for p in model.parameters())  # no weight gradient yet
    if inputs_need_grad:
        for found, wanted in zip(input_grads, expected_inputs, strict=True):
            torch.testing.assert_close(found, wanted, rtol=0, atol=1e-12)
    backward_weight(pending)

    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=0, atol=1e-12, msg=name)
    assert len(fired) == len(expected)  # through AccumulateGrad: data parallel hooks fire
