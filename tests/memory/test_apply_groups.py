"""``optimizer.num_apply_group``: the same parameters as one update, a lower peak of temporary buffers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import epl
from epl_memory.measure import peak_allocated_bytes


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)], nn.Linear(256, 3))


def train(groups: int) -> tuple[list[float], dict[str, torch.Tensor], int]:
    epl.init(epl.Config({"optimizer.num_apply_group": groups}))
    engine = epl.parallelize(
        build(), optimizer=lambda p: torch.optim.AdamW(p, lr=0.01, foreach=True), loss_fn=nn.MSELoss()
    )
    # an LR scheduler rebinds optimizer.step's method to the optimizer: grouped steps are bound methods too
    engine.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda step: 1.0 / (1 + step))
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x, y = torch.randn(16, 256, generator=generator), torch.randn(16, 3, generator=generator)
        losses.append(float(engine.step(x, y)))
    # The peak of one update alone, with the gradients of a last backward in place.
    engine.model.zero_grad()
    nn.functional.mse_loss(engine.model(x), y).backward()
    assert engine.optimizer is not None
    peak = peak_allocated_bytes(engine.optimizer.step)
    return losses, {k: v.clone() for k, v in engine.model.state_dict().items()}, peak


def test_apply_groups_give_the_same_parameters_with_a_lower_peak() -> None:
    losses, state, peak = train(1)
    grouped_losses, grouped_state, grouped_peak = train(4)
    assert grouped_losses == losses
    for key, value in state.items():
        assert torch.equal(grouped_state[key], value), key
    # foreach AdamW allocates temporaries for every parameter of a step: 4 groups hold about a quarter.
    assert grouped_peak < 0.5 * peak, (grouped_peak, peak)


def test_an_optimizer_that_couples_parameters_is_refused() -> None:
    epl.init(epl.Config({"optimizer.num_apply_group": 2}))
    with pytest.raises(epl.ConfigError, match="LBFGS couples all parameters"):
        epl.parallelize(build(), optimizer=lambda p: torch.optim.LBFGS(p))


class _MyAdam(torch.optim.Adam):
    """A subclass: it may change the update, so EPL does not assume Adam's."""


def test_an_optimizer_not_known_either_way_is_grouped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    epl.init(epl.Config({"optimizer.num_apply_group": 2}))
    with caplog.at_level("WARNING", logger="epl.memory"):
        epl.parallelize(build(), optimizer=lambda p: _MyAdam(p))
    assert "_MyAdam is not known to update each parameter" in caplog.text


def test_one_table_says_which_optimizers_update_each_parameter_alone() -> None:
    from epl_memory.optimizer_kinds import updates_each_parameter_alone

    params = list(build().parameters())
    assert updates_each_parameter_alone(torch.optim.AdamW(params)) is True
    assert updates_each_parameter_alone(torch.optim.LBFGS(params)) is False
    assert updates_each_parameter_alone(_MyAdam(params)) is None
