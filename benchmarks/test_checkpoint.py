"""EPL checkpoints against torch.distributed.checkpoint used by hand: same model, 2 processes, same run.

EPL's ``engine.save``/``engine.load`` write logical, layout-free state (whole tensors under
the model's names, optimizer states per parameter, RNG and step) through DCP, atomically
(a ``.partial`` folder renamed when complete). PyTorch's own way for data parallelism is
``dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()})`` on every rank.
Both write to local disk; the ratio is EPL / PyTorch seconds per save and per load.

Asynchronous saves: the seconds ``engine.save(path, asynchronous=True)`` holds the training loop (it
copies the state to CPU buffers and returns; the files are written in the background), over a
synchronous ``engine.save``, and over ``dcp.async_save`` by hand on a gloo group of its own (torchtitan's
way). Each timed call starts once the previous background write is complete.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
from tests.helpers.distributed import run_ranks

from benchmarks.harness import Ratio, ResultRow, Section, compare, ms, record, short_mode

pytestmark = pytest.mark.multiprocess

DCP = "`torch.distributed.checkpoint` by hand (`dcp.{}`)"
ASYNC = "`dcp.async_save` by hand, gloo group of its own"
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
    "disk; the larger of the two ranks' ratios. Disk timings on a shared machine are noisy. Asynchronous save: "
    "the seconds `engine.save(path, asynchronous=True)` holds the training loop (state copied to CPU buffers, "
    "files written in the background) over a synchronous `engine.save`, and over `dcp.async_save` by hand on "
    "a gloo group of its own; each timed call starts once the previous background write is complete.",
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

    from epl.runtime.checkpoint import wait_for_background_save

    background = dist.new_group(backend="gloo")
    pending: list[Any] = []

    def torch_async_save() -> None:
        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        pending.append(dcp.async_save(state, checkpoint_id=f"{folder}/torch-async", process_group=background))

    def written() -> None:  # before each timed call: the previous background write is complete
        while pending:
            pending.pop().result()
        wait_for_background_save()
        dist.barrier()

    barrier = dist.barrier
    saving = compare(
        "checkpoint_save", torch_save, lambda: engine.save(f"{folder}/epl"), rounds=rounds,
        calls_per_round=calls, warmup=1, sync=barrier, save=rank == 0,
    )  # fmt: skip
    loading = compare(
        "checkpoint_load", torch_load, lambda: engine.load(f"{folder}/epl"), rounds=rounds,
        calls_per_round=calls, warmup=1, sync=barrier, save=rank == 0,
    )  # fmt: skip
    blocking = compare(
        "checkpoint_async_vs_sync", lambda: engine.save(f"{folder}/epl"),
        lambda: engine.save(f"{folder}/epl-async", asynchronous=True), rounds=rounds, calls_per_round=1,
        warmup=1, sync=written, save=rank == 0,
    )  # fmt: skip
    blocking_torch = compare(
        "checkpoint_async_vs_dcp_async_save", torch_async_save,
        lambda: engine.save(f"{folder}/epl-async", asynchronous=True), rounds=rounds, calls_per_round=1,
        warmup=1, sync=written, save=rank == 0,
    )  # fmt: skip
    written()
    parameters = sum(p.numel() for p in model.parameters())
    lines = [saving.line(), loading.line(), blocking.line(), blocking_torch.line()]
    return {
        "save": saving.ratio,
        "load": loading.ratio,
        "async": blocking.ratio,
        "async_torch": blocking_torch.ratio,
        "ms": {
            "save": (saving.baseline_s * 1e3, saving.epl_s * 1e3),
            "load": (loading.baseline_s * 1e3, loading.epl_s * 1e3),
            "async": (blocking.baseline_s * 1e3, blocking.epl_s * 1e3),
            "async_torch": (blocking_torch.baseline_s * 1e3, blocking_torch.epl_s * 1e3),
        },
        "parameters": parameters,
        "lines": lines,
    }


def test_checkpoint_save_and_load_against_dcp_by_hand() -> None:
    with tempfile.TemporaryDirectory(prefix="epl-bench-ckpt-") as folder:
        widths, rounds, calls = (SHORT_WIDTHS, 2, 1) if short_mode() else (FULL_WIDTHS, 7, 2)
        results = run_ranks(race, 2, folder, widths, rounds, calls, timeout=600)
    size = f"{results[0]['parameters'] / 1e6:.1f}M-parameter MLP + Adam, 2 processes"
    held = f"Checkpoint save, asynchronous (time the step is held), {size}"
    kinds = {  # result key: feature, against, plot label, the baseline's name in the details
        "save": (f"Checkpoint save, {size}", DCP.format("save"), "checkpoint save vs dcp.save", "dcp.save"),
        "load": (f"Checkpoint load, {size}", DCP.format("load"), "checkpoint load vs dcp.load", "dcp.load"),
        "async": (held, "EPL's synchronous `engine.save`", "async save held vs engine.save", "engine.save"),
        "async_torch": (held, ASYNC, "async save held vs dcp.async_save", "dcp.async_save"),
    }
    figures = {f"{what}_ratio_per_rank": [r[what] for r in results] for what in kinds}
    rows, details = [], []
    for what, (feature, against, plot, baseline) in kinds.items():
        per_rank = figures[f"{what}_ratio_per_rank"]
        rows.append(ResultRow(feature, against, time=(Ratio(max(per_rank)),), plot=plot))
        times = "; ".join(
            f"rank {i}: {baseline} {ms(r['ms'][what][0])}, EPL {ms(r['ms'][what][1])}" for i, r in enumerate(results)
        )
        ratios = ", ".join(f"{r:.3f}" for r in per_rank)
        details.append(f"{plot}: EPL / {baseline} per rank {ratios} ({times})")
    record("checkpoint", rows, section=SECTION, details=details)
    print("\n" + "\n".join(results[0]["lines"]), figures)
    for what in ("save", "load"):
        assert max(figures[f"{what}_ratio_per_rank"]) < MAX_RATIO, figures
    assert max(figures["async_ratio_per_rank"]) < 1.0, figures  # returning before the write is the point
