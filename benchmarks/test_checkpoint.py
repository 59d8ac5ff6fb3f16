"""EPL checkpoints against torch.distributed.checkpoint used by hand: same model, 2 processes, same run.

EPL's ``engine.save``/``engine.load`` write logical, layout-free state (whole tensors under
the model's names, optimizer states per parameter, RNG and step) through DCP, atomically
(a ``.partial`` folder renamed when complete). PyTorch's own way for data parallelism is
``dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()})`` on every rank.
Both write to local disk; the ratio is EPL / PyTorch seconds per save and per load.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
from tests.helpers.distributed import run_ranks

from benchmarks.harness import Ratio, ResultRow, Section, compare, record, short_mode

pytestmark = pytest.mark.multiprocess

#: Widths of the MLP (short: 0.8M parameters, full: 6.3M); passed to the ranks, which do not see the mode.
SHORT_WIDTHS, FULL_WIDTHS = (256, 1024, 512, 256), (512, 2048, 2048, 512)
MAX_RATIO = 3.0  # gross regressions only: disk timings on a shared machine are noisy
SECTION = Section(
    "Checkpoints",
    __file__,
    "Seconds per save and per load of EPL's `engine.save` / `engine.load` (logical, layout-free state through "
    "torch.distributed.checkpoint: whole tensors under the model's names, optimizer states per parameter, "
    "RNG and step, written atomically) over `torch.distributed.checkpoint` used by hand (`dcp.save` / "
    "`dcp.load` of the model's and optimizer's `state_dict`), the same MLP with Adam on 2 processes, local "
    "disk; the larger of the two ranks' ratios. Disk timings on a shared machine are noisy.",
)


def race(folder: str, widths: tuple[int, ...], rounds: int, calls: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn

    import epl

    def build() -> nn.Module:
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for a, b in zip(widths, widths[1:], strict=False):
            layers += [nn.Linear(a, b), nn.ReLU()]
        return nn.Sequential(*layers[:-1])

    epl.init(epl.Config({}))
    engine = epl.parallelize(build(), optimizer=lambda p: torch.optim.Adam(p, lr=1e-3), loss_fn=nn.MSELoss())
    x, y = torch.randn(8, widths[0]), torch.randn(8, widths[-1])
    engine.step(x, y)
    model = build()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    rank = dist.get_rank()

    def torch_save() -> None:
        dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=f"{folder}/torch")

    def torch_load() -> None:
        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        dcp.load(state, checkpoint_id=f"{folder}/torch")

    barrier = dist.barrier
    saving = compare(
        "checkpoint_save", torch_save, lambda: engine.save(f"{folder}/epl"), rounds=rounds,
        calls_per_round=calls, warmup=1, sync=barrier, save=rank == 0,
    )  # fmt: skip
    loading = compare(
        "checkpoint_load", torch_load, lambda: engine.load(f"{folder}/epl"), rounds=rounds,
        calls_per_round=calls, warmup=1, sync=barrier, save=rank == 0,
    )  # fmt: skip
    parameters = sum(p.numel() for p in model.parameters())
    lines = [saving.line(), loading.line()]
    return {"save": saving.ratio, "load": loading.ratio, "parameters": parameters, "lines": lines}


def test_checkpoint_save_and_load_against_dcp_by_hand() -> None:
    with tempfile.TemporaryDirectory(prefix="epl-bench-ckpt-") as folder:
        widths, rounds, calls = (SHORT_WIDTHS, 2, 1) if short_mode() else (FULL_WIDTHS, 7, 2)
        results = run_ranks(race, 2, folder, widths, rounds, calls, timeout=600)
    figures = {
        "parameters": results[0]["parameters"],
        "save_ratio_per_rank": [r["save"] for r in results],
        "load_ratio_per_rank": [r["load"] for r in results],
    }
    rows, details = [], []
    for what in ("save", "load"):
        per_rank = figures[f"{what}_ratio_per_rank"]
        rows.append(
            ResultRow(
                f"Checkpoint {what}, {figures['parameters'] / 1e6:.1f}M-parameter MLP + Adam, 2 processes",
                f"`torch.distributed.checkpoint` by hand (`dcp.{what}`)",
                time=(Ratio(max(per_rank)),),
                plot=f"checkpoint {what} vs dcp.{what}",
            )
        )
        details.append(f"{what}: EPL / dcp per rank " + ", ".join(f"{r:.3f}" for r in per_rank))
    record("checkpoint", rows, section=SECTION, details=details)
    print("\n" + "\n".join(results[0]["lines"]), figures)
    assert max(figures["save_ratio_per_rank"]) < MAX_RATIO, figures
    assert max(figures["load_ratio_per_rank"]) < MAX_RATIO, figures
