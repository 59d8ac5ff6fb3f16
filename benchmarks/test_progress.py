"""Cost of ``epl.Progress`` against the plain PyTorch loop with its usual tqdm bar (target: within 3%)."""

from __future__ import annotations

import io

import pytest
import torch
from tqdm import tqdm

import epl
from benchmarks.harness import ResultRow, Section, compare, record, short_mode
from benchmarks.test_local_step import BATCH, LOSS, WIDTH, make_model, plain_step

MAX_RATIO = 1.5 if short_mode() else 1.08
SECTION = Section(
    "Progress",
    __file__,
    "Time of a step shown by `epl.Progress` (`engine.step` then `progress.update(loss)`, a bar redrawn at most "
    "every 0.5 s) over the plain PyTorch loop with the usual tqdm bar (`set_postfix(loss=loss.item())` and "
    "`update()` every step), both drawing into a terminal-like buffer: the local-step MLP, batch 64, Adam, one "
    "thread. The ratio is the local step's overhead plus the bar's; target <= 1.03.",
)


class Terminal(io.StringIO):
    """A buffer that says it is a terminal, so that both bars draw."""

    def isatty(self) -> bool:
        return True


@pytest.mark.benchmark(group="progress")
def test_progress_overhead(benchmark) -> None:  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    x, y = torch.randn(BATCH, WIDTH), torch.randint(0, 10, (BATCH,))
    epl.init()
    engine = epl.parallelize(make_model(), optimizer=lambda p: torch.optim.Adam(p, lr=1e-3), loss_fn=LOSS)
    model, opt = engine.model, engine.optimizer
    bar = tqdm(file=Terminal(), unit="step", mininterval=0.5)
    progress = epl.Progress(engine, file=Terminal())

    def plain() -> None:
        opt.zero_grad()
        loss = LOSS(model(x), y)
        loss.backward()
        opt.step()
        bar.set_postfix(loss=loss.item(), refresh=False)
        bar.update()

    def ours() -> None:
        progress.update(engine.step(x, y))

    plain_step(model, opt, x, y, 1)  # warm-up outside the timing
    result = compare(
        "progress", plain, ours, rounds=5 if short_mode() else 40, calls_per_round=5 if short_mode() else 20
    )
    row = ResultRow("`engine.step` + `epl.Progress.update`", "plain loop + tqdm bar", plot="progress bar vs tqdm")
    record("progress", [result.row(row)], section=SECTION, details=[result.detail()])
    benchmark.extra_info.update(pytorch_ms=result.baseline_s * 1e3, epl_ms=result.epl_s * 1e3, ratio=result.ratio)
    benchmark.pedantic(ours, rounds=3 if short_mode() else 20, iterations=1)
    bar.close()
    progress.close()
    assert result.ratio < MAX_RATIO, result.line()
