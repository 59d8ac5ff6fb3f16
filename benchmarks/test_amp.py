"""AMP O1 on a 4-layer transformer: EPL against ``torch.autocast`` + ``torch.amp.GradScaler``, and against float32.

One process, one thread, CPU (autocast in bfloat16). Three copies of the same model
(same seed): plain float32 PyTorch, PyTorch's documented AMP loop (forward and loss
under ``torch.autocast``, ``GradScaler("cpu", init_scale=2**15)``: scale, backward,
step, update) and EPL with ``amp.level = "O1"``. Before timing, the AMP loop and EPL
take the same training steps (bitwise). Measured:

* step time, EPL against the AMP loop (EPL's overhead: the forward context, the fused
  unscale-and-check, the finiteness decision) and against float32 (what AMP costs or
  saves on this machine);
* the peak of a training step and the activations a forward keeps for backward
  (the CPU allocator's running total under the profiler; a step's peak over the second of two steps).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import epl
from benchmarks.harness import Ratio, ResultRow, Section, compare, mib, ms, record, short_mode
from epl_memory.measure import kept_allocated_bytes, steady_peak_allocated_bytes

LAYERS, WIDTH, HEADS, BATCH, SEQUENCE = 4, 128, 4, 8, 64 if short_mode() else 128
#: The same arithmetic as the AMP loop plus a little bookkeeping; CI only catches gross regressions.
MAX_TIME_RATIO = 2.0 if short_mode() else 1.15
MAX_PEAK_RATIO = 1.05
SECTION = Section(
    "AMP O1",
    __file__,
    'EPL with `amp.level = "O1"` (bfloat16 autocast on CPU) on a 4-layer transformer, one thread, over '
    "PyTorch's documented AMP loop (`torch.autocast` + `GradScaler`) and over plain float32. Time: step "
    "time. Memory: *step peak* is the peak a training step allocates (second of two steps), "
    "*activations* the bytes a forward keeps for backward. Against the AMP loop the ratios are EPL's "
    "overhead (target: time <= 1.15, memory <= 1.05); against float32 they are what AMP costs or "
    "saves on this machine (bfloat16 matmuls on a CPU without bf16 units are much slower than float32).",
)


class Encoder(nn.Module):
    """Transformer layers and a linear head: [batch, sequence, width] -> the same."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            *(nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True) for _ in range(LAYERS))
        )
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[batch, sequence, width] -> the same."""
        return self.head(self.layers(x))


def build() -> Encoder:
    torch.manual_seed(0)
    return Encoder()


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01)


def float32_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.detach()


def amp_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """PyTorch's documented AMP recipe."""
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss.detach()


def test_amp_against_torch_autocast_and_grad_scaler() -> None:
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, SEQUENCE, WIDTH, generator=generator)
    y = torch.randn(BATCH, SEQUENCE, WIDTH, generator=generator)

    epl.init(epl.Config({"amp.level": "O1"}))
    engine = epl.parallelize(build(), optimizer=sgd, loss_fn=nn.MSELoss())
    torch_model, fp32_model = build(), build()
    torch_opt, fp32_opt = sgd(torch_model.parameters()), sgd(fp32_model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**15)

    def run_torch() -> torch.Tensor:
        return amp_step(torch_model, torch_opt, scaler, x, y)

    def run_epl() -> torch.Tensor:
        return engine.step(x, y)

    def run_fp32() -> torch.Tensor:
        return float32_step(fp32_model, fp32_opt, x, y)

    # The same training steps on both AMP sides.
    for _ in range(2):
        assert torch.equal(run_torch(), run_epl())
    for name, value in torch_model.state_dict().items():
        assert torch.equal(value, engine.model.state_dict()[name]), name
    assert engine.loss_scaler.scale == scaler.get_scale() == 2.0**15

    outputs: list[torch.Tensor] = []  # kept alive: what a forward leaves for backward is measured
    kept = {
        "float32": kept_allocated_bytes(lambda: outputs.append(fp32_model(x))),
        "torch_amp": kept_allocated_bytes(lambda: outputs.append(_autocast_forward(torch_model, x))),
        "epl": kept_allocated_bytes(lambda: outputs.append(engine.model(x))),
    }
    outputs.clear()
    peaks = {
        "float32": steady_peak_allocated_bytes(run_fp32),
        "torch_amp": steady_peak_allocated_bytes(run_torch),
        "epl": steady_peak_allocated_bytes(run_epl),
    }
    rounds, calls = (3, 2) if short_mode() else (11, 3)
    against_torch = compare("amp_vs_torch_amp", run_torch, run_epl, rounds=rounds, calls_per_round=calls, warmup=1)
    against_fp32 = compare("amp_vs_float32", run_fp32, run_epl, rounds=rounds, calls_per_round=calls, warmup=1)
    figures: dict[str, Any] = {
        "layers": LAYERS,
        "width": WIDTH,
        "batch": BATCH,
        "sequence": SEQUENCE,
        "kept_after_forward_bytes": kept,
        "step_peak_bytes": peaks,
        "peak_ratio_vs_torch_amp": peaks["epl"] / peaks["torch_amp"],
        "peak_ratio_vs_float32": peaks["epl"] / peaks["float32"],
        "activation_ratio_vs_float32": kept["epl"] / kept["float32"],
        "time_ratio_vs_torch_amp": against_torch.ratio,
        "time_ratio_vs_float32": against_fp32.ratio,
        "torch_amp_ms": against_torch.baseline_s * 1e3,
        "float32_ms": against_fp32.baseline_s * 1e3,
        "epl_ms": against_torch.epl_s * 1e3,
    }
    feature = f"AMP O1, {LAYERS}-layer transformer"
    rows = [
        ResultRow(
            feature,
            "`torch.autocast` + `GradScaler`",
            time=(Ratio(against_torch.ratio),),
            memory=(
                Ratio(peaks["epl"] / peaks["torch_amp"], "step peak"),
                Ratio(kept["epl"] / kept["torch_amp"], "activations"),
            ),
            plot="AMP O1 vs torch.autocast + GradScaler",
        ),
        ResultRow(
            feature,
            "float32 PyTorch (no AMP)",
            time=(Ratio(against_fp32.ratio),),
            memory=(
                Ratio(peaks["epl"] / peaks["float32"], "step peak"),
                Ratio(kept["epl"] / kept["float32"], "activations"),
            ),
            plot="AMP O1 vs float32",
        ),
    ]
    details = [
        f"step time: EPL {ms(figures['epl_ms'])}, torch AMP {ms(figures['torch_amp_ms'])}, "
        f"float32 {ms(figures['float32_ms'])} (batch {BATCH}, sequence {SEQUENCE})",
        f"peak of a step: EPL {mib(peaks['epl'])}, torch AMP {mib(peaks['torch_amp'])}, "
        f"float32 {mib(peaks['float32'])}",
        f"activations kept after forward: EPL {mib(kept['epl'])}, torch AMP {mib(kept['torch_amp'])}, "
        f"float32 {mib(kept['float32'])}",
    ]
    record("amp", rows, section=SECTION, details=details)
    print(
        f"\nAMP O1, {LAYERS} layers: step peak EPL {peaks['epl'] / 2**20:.1f} MiB, torch AMP "
        f"{peaks['torch_amp'] / 2**20:.1f} MiB, float32 {peaks['float32'] / 2**20:.1f} MiB; activations kept EPL "
        f"{kept['epl'] / 2**20:.1f} MiB, float32 {kept['float32'] / 2**20:.1f} MiB; time EPL/torch AMP "
        f"{against_torch.ratio:.2f}, EPL/float32 {against_fp32.ratio:.2f}"
    )
    assert figures["peak_ratio_vs_torch_amp"] <= MAX_PEAK_RATIO, figures
    assert kept["epl"] <= kept["torch_amp"] * MAX_PEAK_RATIO, figures
    assert against_torch.ratio <= MAX_TIME_RATIO, against_torch.line()


def _autocast_forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(x)
