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


class Shapes(nn.Module):
    """Graph shapes the split must handle: a weight used on two input paths (two recorded nodes in one
    branch, one reached from the other), an op with several outputs (chunk), a parameter that reaches the
    output by no input path, and an output computed straight by a Linear (a recorded node is a root)."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(6, 6)
        self.mix = nn.Linear(3, 6)
        self.bias_only = nn.Parameter(torch.randn(6))
        self.head = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.shared(self.shared(x).tanh())  # the same weights twice along the input path
        left, right = h.chunk(2, dim=1)
        mixed = self.mix(left) * right.sum(1, keepdim=True)
        return self.head(mixed), self.bias_only.exp().expand(x.shape[0], 6), (self.bias_only * 2).sum()


@pytest.mark.parametrize("engine_path", [True, False])
def test_split_backward_graph_shapes_bitwise(engine_path: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Micro-batch after micro-batch (the first makes the plan, the others reuse it), bit for bit the gradients of
    plain backwards, through autograd's engine function or the public API."""
    import epl_pipeline.split_backward as split_backward

    if not engine_path:
        monkeypatch.setattr(split_backward, "_engine_run_backward", None)
    monkeypatch.setattr(split_backward, "_PLANS", {})
    torch.manual_seed(0)
    model = Shapes()
    batches = [torch.randn(5, 6) for _ in range(3)]
    grads = [[torch.randn(5, 6), torch.randn(5, 6), torch.randn(())] for _ in batches]
    expected_inputs = []
    for x, g in zip(batches, grads, strict=True):
        x = x.clone().requires_grad_(True)
        torch.autograd.backward(model(x), g)
        expected_inputs.append(x.grad)
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    for x, g, wanted in zip(batches, grads, expected_inputs, strict=True):
        x = x.clone().requires_grad_(True)
        input_grads, pending = backward_input(list(model(x)), g, [x], list(model.parameters()))
        assert torch.equal(input_grads[0], wanted)
        backward_weight(pending)
        assert any(len(branch.nodes) > 1 for branch in pending.branches)  # the shared weights' branch
        assert any(branch.from_outputs is not None for branch in pending.branches)  # bias_only
    for name, param in model.named_parameters():
        assert torch.equal(param.grad, expected[name]), name
    assert len(split_backward._PLANS) == 1  # one structure, planned once


def test_split_backward_replans_when_the_graph_changes() -> None:
    """A forward that takes another path (here: a layer skipped) makes another graph, and gets its own plan."""
    torch.manual_seed(0)
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    params = [*first.parameters(), *second.parameters()]

    def forward(x: torch.Tensor, skip: bool) -> torch.Tensor:
        h = first(x).relu()
        return h if skip else second(h)

    for skip in (False, True, False):
        x, grad = torch.randn(3, 4), torch.randn(3, 4)
        for p in params:
            p.grad = None
        x1 = x.clone().requires_grad_(True)
        torch.autograd.backward([forward(x1, skip)], [grad])
        expected = [None if p.grad is None else p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        x2 = x.clone().requires_grad_(True)
        input_grads, pending = backward_input([forward(x2, skip)], [grad], [x2], params)
        backward_weight(pending)
        assert torch.equal(input_grads[0], x1.grad)
        for p, wanted in zip(params, expected, strict=True):
            assert (p.grad is None and wanted is None) or torch.equal(p.grad, wanted)


def test_backward_scalar_and_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """``backward`` equals ``torch.autograd.backward``: a scalar's None gradient is ones, and a gradient of the
    wrong shape gets the public function's own error."""
    import epl_pipeline.split_backward as split_backward

    weight = torch.randn(3, requires_grad=True)
    split_backward.backward([(weight * 2).sum()], [None])
    assert torch.equal(weight.grad, torch.full((3,), 2.0))
    with pytest.raises(RuntimeError, match="Mismatch in shape"):
        split_backward.backward([weight * 2], [torch.ones(4)])
    with pytest.raises(RuntimeError, match="implicitly created only for scalar"):
        split_backward.backward([weight * 2], [None])
