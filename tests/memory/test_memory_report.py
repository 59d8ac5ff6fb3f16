"""``engine.memory_report()``: exact bytes of parameters, gradients and states; measured activations."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import epl
from tests.helpers.distributed import run_ranks


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 40), nn.Tanh(), nn.Linear(40, 8))


def report(config: dict[str, Any]) -> dict[str, Any]:
    """Train one step with Adam (float32), then report; also measure the activations of a batch."""
    epl.init(epl.Config(config))
    engine = epl.parallelize(build(), optimizer=lambda p: torch.optim.Adam(p, lr=0.01), loss_fn=nn.MSELoss())
    x, y = torch.randn(16, 32), torch.randn(16, 8)
    before = engine.memory_report()
    engine.step(x, y)
    grads = [p.grad.clone() for p in engine.model.parameters()]
    after = engine.memory_report(x, y)
    unchanged = all(torch.equal(p.grad, g) for p, g in zip(engine.model.parameters(), grads, strict=True))
    return {"before": before, "after": after, "grads_restored": unchanged, "text": str(after)}


PSI = sum(p.numel() for p in build().parameters())
TENSORS = len(list(build().parameters()))


def test_adam_in_one_process_follows_the_formula() -> None:
    result = report({})
    before, after = result["before"], result["after"]
    assert before.parameter_bytes == 4 * PSI and before.gradient_bytes == 0 and before.optimizer_state_bytes == 0
    assert after.parameter_bytes == 4 * PSI and after.gradient_bytes == 4 * PSI
    assert 8 * PSI <= after.optimizer_state_bytes <= 8 * PSI + 4 * TENSORS  # exp_avg, exp_avg_sq (+ step counters)
    assert after.activation_peak_bytes is not None and after.activation_peak_bytes > 0
    assert result["grads_restored"] and "optimizer states" in result["text"]


def test_checkpointing_lowers_the_measured_activations() -> None:
    plain = report({})["after"].activation_peak_bytes
    checkpointed = report({"gradient_checkpoint.type": "auto"})["after"].activation_peak_bytes
    assert checkpointed < plain


@pytest.mark.multiprocess
def test_zero_v0_holds_one_nth_of_everything_per_device() -> None:
    reports = [r["after"] for r in run_ranks(report, 2, {"zero.level": "v0"}, timeout=120)]
    for each in reports:  # FSDP2's chunks: 4Ψ/N parameters + 4Ψ/N gradients + 8Ψ/N states (even rows here)
        assert each.parameter_bytes == 4 * PSI // 2 and each.gradient_bytes == 4 * PSI // 2
        assert each.optimizer_state_bytes == 8 * PSI // 2


def replica_of_two_devices() -> dict[str, int]:
    """replicate(2): one replica whose two devices split its batch; the report measures this device's half."""
    from epl.runtime.activations import SavedActivations

    epl.init(epl.Config({}))
    torch.manual_seed(0)
    with epl.replicate(2):
        model = build()
    plain = build()
    engine = epl.parallelize(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.MSELoss())
    x, y = torch.randn(8, 32), torch.randn(8, 8)
    measured = engine.memory_report(x, y).activation_peak_bytes
    meter = SavedActivations(exclude=[*plain.parameters(), x, y])  # like the report: not the batch itself
    half = slice(4 * engine.context.cluster.rank, 4 * (engine.context.cluster.rank + 1))
    with meter:
        nn.functional.mse_loss(plain(x[half]), y[half]).backward()
    return {"report": measured or 0, "half": meter.peak}


def test_a_replica_split_over_devices_measures_each_devices_part() -> None:
    for result in run_ranks(replica_of_two_devices, 2, timeout=60):
        assert result["report"] == result["half"] > 0
