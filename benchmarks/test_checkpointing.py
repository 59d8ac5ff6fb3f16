"""Gradient checkpointing on a 12-layer transformer: EPL against ``torch.utils.checkpoint`` and against none.

One process, one thread. Three copies of the same model (same seed): plain PyTorch,
the same layers wrapped by hand in ``torch.utils.checkpoint`` (non-reentrant), and
EPL with ``gradient_checkpoint.type = "auto"`` (which picks the 12 layers). Before
timing, all three take the same training step. Measured:

* activation memory: the bytes a forward leaves allocated for backward (the CPU
  allocator's running total under the profiler, after the forward, minus before);
* the peak of a whole training step (forward, backward, update) the same way, over the
  second of two steps (``steady_peak_allocated_bytes``: gradients freed and made again count once);
* step time, EPL against plain (the cost of recomputation) and against torch's own.

Targets (issue 7): at least 50% less activation memory for at most 35% more time.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

import epl
from benchmarks.harness import Ratio, ResultRow, Section, compare, mib, ms, record, short_mode
from epl_memory.measure import kept_allocated_bytes, steady_peak_allocated_bytes

LAYERS, WIDTH, HEADS, BATCH, SEQUENCE = 12, 64, 4, 8, 64 if short_mode() else 128
#: Recomputation costs about one more forward (a third of a step); CI only catches gross regressions.
MAX_TIME_RATIO = 3.0  # a gross regression; the target is reported, not asserted:
TARGET_TIME_RATIO = 1.35  # not met by recomputing every layer on this 2-core CPU (1.4-2.0 measured)
MAX_TIME_RATIO_AGAINST_TORCH = 2.0 if short_mode() else 1.15
SECTION = Section(
    "Gradient checkpointing",
    __file__,
    'EPL `gradient_checkpoint.type = "auto"` on 12 transformer layers, one thread, over no checkpointing '
    "and over the same layers wrapped by hand in `torch.utils.checkpoint`. Memory: *activations* kept "
    "after a forward (target against none: <= 0.5), *step peak* of a training step. Time: step time; "
    "against none it is the cost of recomputation (issue target 1.35, not met on this 2-core CPU), "
    "against torch EPL's own overhead.",
)


class Encoder(nn.Module):
    """Twelve transformer layers and a linear head; ``recompute`` wraps each layer by hand."""

    def __init__(self, recompute: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True) for _ in range(LAYERS)
        )
        self.head = nn.Linear(WIDTH, WIDTH)
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[batch, sequence, width] -> the same."""
        for layer in self.layers:
            x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False) if self.recompute else layer(x)
        return self.head(x)


def build(recompute: bool = False) -> Encoder:
    torch.manual_seed(0)
    return Encoder(recompute)


def step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.detach()


def kept_after_forward(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes the forward leaves allocated for backward (its output included)."""
    kept: list[torch.Tensor] = []
    return kept_allocated_bytes(lambda: kept.append(model(x)))


def test_checkpointing_against_torch_and_against_none() -> None:
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, SEQUENCE, WIDTH, generator=generator)
    y = torch.randn(BATCH, SEQUENCE, WIDTH, generator=generator)

    epl.init(epl.Config({"gradient_checkpoint.type": "auto"}))
    engine = epl.parallelize(build(), optimizer=lambda p: torch.optim.SGD(p, lr=0.01), loss_fn=nn.MSELoss())
    from epl_memory.checkpointing import CheckpointingState

    plan = engine.context.state(CheckpointingState).plan
    assert plan is not None and plan.describe() == f"{LAYERS} modules"
    plain, by_hand = build(), build(recompute=True)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.01)
    hand_opt = torch.optim.SGD(by_hand.parameters(), lr=0.01)

    # The same training step on all three sides.
    losses = [float(step(plain, plain_opt, x, y)), float(step(by_hand, hand_opt, x, y)), float(engine.step(x, y))]
    assert losses[0] == losses[1] == losses[2], losses
    for name, value in plain.state_dict().items():
        assert torch.equal(value, engine.model.state_dict()[name]), name

    kept = {
        "plain": kept_after_forward(plain, x),
        "torch": kept_after_forward(by_hand, x),
        "epl": kept_after_forward(engine.model, x),
    }
    peaks = {
        "plain": steady_peak_allocated_bytes(lambda: step(plain, plain_opt, x, y)),
        "torch": steady_peak_allocated_bytes(lambda: step(by_hand, hand_opt, x, y)),
        "epl": steady_peak_allocated_bytes(lambda: engine.step(x, y)),
    }
    rounds, calls = (3, 2) if short_mode() else (11, 3)
    against_plain = compare(
        "checkpointing_vs_none",
        lambda: step(plain, plain_opt, x, y),
        lambda: engine.step(x, y),
        rounds=rounds,
        calls_per_round=calls,
        warmup=1,
    )
    against_torch = compare(
        "checkpointing_vs_torch",
        lambda: step(by_hand, hand_opt, x, y),
        lambda: engine.step(x, y),
        rounds=rounds,
        calls_per_round=calls,
        warmup=1,
    )
    figures: dict[str, Any] = {
        "layers": LAYERS,
        "batch": BATCH,
        "sequence": SEQUENCE,
        "kept_after_forward_bytes": kept,
        "activation_ratio_vs_none": kept["epl"] / kept["plain"],
        "activation_ratio_vs_torch": kept["epl"] / kept["torch"],
        "step_peak_bytes": peaks,
        "time_ratio_vs_none": against_plain.ratio,
        "time_ratio_vs_torch": against_torch.ratio,
        "time_target_met": against_plain.ratio <= TARGET_TIME_RATIO,
        "plain_ms": against_plain.baseline_s * 1e3,
        "torch_ms": against_torch.baseline_s * 1e3,
        "epl_ms": against_plain.epl_s * 1e3,
    }
    feature = f"Gradient checkpointing `auto`, {LAYERS} layers"
    rows = [
        ResultRow(
            feature,
            "no checkpointing",
            time=(Ratio(against_plain.ratio),),
            memory=(
                Ratio(kept["epl"] / kept["plain"], "activations"),
                Ratio(peaks["epl"] / peaks["plain"], "step peak"),
            ),
            plot="checkpointing vs none",
        ),
        ResultRow(
            feature,
            "`torch.utils.checkpoint` by hand",
            time=(Ratio(against_torch.ratio),),
            memory=(
                Ratio(kept["epl"] / kept["torch"], "activations"),
                Ratio(peaks["epl"] / peaks["torch"], "step peak"),
            ),
            plot="checkpointing vs torch.utils.checkpoint",
        ),
    ]
    met = "met" if figures["time_target_met"] else "not met"
    details = [
        f"step time: EPL {ms(figures['epl_ms'])}, torch.utils.checkpoint {ms(figures['torch_ms'])}, "
        f"none {ms(figures['plain_ms'])} (batch {BATCH}, sequence {SEQUENCE}); "
        f"time target (<= {TARGET_TIME_RATIO} x none) {met}",
        f"activations kept after forward: EPL {mib(kept['epl'])}, torch {mib(kept['torch'])}, "
        f"none {mib(kept['plain'])}",
        f"peak of a step: EPL {mib(peaks['epl'])}, torch {mib(peaks['torch'])}, none {mib(peaks['plain'])}",
    ]
    record("checkpointing", rows, section=SECTION, details=details)
    print(
        f"\ncheckpointing {LAYERS} layers: activations kept EPL {kept['epl'] / 2**20:.1f} MiB, torch "
        f"{kept['torch'] / 2**20:.1f} MiB, none {kept['plain'] / 2**20:.1f} MiB "
        f"(EPL/none {figures['activation_ratio_vs_none']:.2f}); step peak EPL {peaks['epl'] / 2**20:.1f} MiB, "
        f"none {peaks['plain'] / 2**20:.1f} MiB; time EPL/none {against_plain.ratio:.2f}, "
        f"EPL/torch {against_torch.ratio:.2f}; time target (<= {TARGET_TIME_RATIO}) "
        f"{'met' if figures['time_target_met'] else 'not met'}"
    )
    assert figures["activation_ratio_vs_none"] <= 0.5, figures
    assert figures["activation_ratio_vs_torch"] <= 1.05, figures
    assert against_plain.ratio <= MAX_TIME_RATIO, against_plain.line()
    assert against_torch.ratio <= MAX_TIME_RATIO_AGAINST_TORCH, against_torch.line()
