"""epl.Progress in one process: plain lines, the tqdm bar, TensorBoard scalars, throughput counts, clear errors."""

from __future__ import annotations

import dataclasses
import io
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import epl
from epl.runtime.batch import samples_and_tokens

STEPS = 8


def _engine() -> epl.Engine:
    epl.init(epl.Config({"optimizer.max_grad_norm": 10.0}))
    torch.manual_seed(0)
    return epl.parallelize(
        nn.Linear(4, 1),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.05),
        loss_fn=nn.MSELoss(),
        lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5),
    )


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 4, generator=generator), torch.randn(6, 1, generator=generator)) for _ in range(STEPS)]


class Terminal(io.StringIO):
    """A text stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_plain_lines_show_loss_lr_norm_throughput_and_eta_every_log_every_steps() -> None:
    engine, out = _engine(), io.StringIO()
    progress = epl.Progress(engine, total=STEPS, log_every=2, file=out)
    shown = {}
    for x, y in _batches():
        loss = engine.step(x, y)
        shown[engine.global_step] = (float(loss), engine.lr, engine.grad_norm)
        progress.update(loss)
    progress.close()
    assert progress.samples_per_second > 0 and progress.tokens_per_second is None  # float inputs: no tokens
    lines = out.getvalue().splitlines()
    assert [int(re.match(r"step (\d+)/8 ", line).group(1)) for line in lines] == [2, 4, 6, 8]
    for line in lines:
        step = int(line.split()[1].split("/")[0])
        loss, lr, norm = shown[step]
        assert f"({100 * step // STEPS}%)" in line
        assert f"loss {loss:.4f}" in line and f"lr {lr:.2e}" in line and f"grad_norm {norm:.4f}" in line
        assert re.search(r"samples/s \d+\.\d", line) and "tokens/s" not in line  # float inputs: no tokens
        assert re.search(r"elapsed \d\d:\d\d  eta \d\d:\d\d$", line)


def test_a_terminal_gets_a_tqdm_bar_redrawn_in_place_and_log_lines_above_it() -> None:
    engine, out = _engine(), Terminal()
    with epl.Progress(engine, total=STEPS, file=out, refresh_seconds=0) as progress:
        for x, y in _batches():
            progress.update(engine.step(x, y))
        progress.log(val_loss=0.25)
    text = out.getvalue()
    redraws = text.split("\r")
    assert len(redraws) > STEPS  # one per step (refresh_seconds=0), and the start
    final = [redraw for redraw in redraws if "8/8" in redraw][-1]
    assert re.search(r"^train: 100%\|#+\| 8/8 \[.*step/s, loss \d\.\d{4}  lr 3\.13e-03  grad_norm", final)
    assert "step 8  val_loss 0.2500\n" in text


def test_a_resumed_run_starts_its_bar_and_eta_at_the_engines_step() -> None:
    engine, out = _engine(), io.StringIO()
    batches = _batches()
    for x, y in batches[:4]:
        engine.step(x, y)
    progress = epl.Progress(engine, total=STEPS, log_every=2, file=out)
    for x, y in batches[4:]:
        progress.update(engine.step(x, y))
    assert [line.split()[1] for line in out.getvalue().splitlines()] == ["6/8", "8/8"]


def test_tensorboard_gets_every_logged_step(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    engine = _engine()
    losses = {}
    with epl.Progress(engine, total=STEPS, log_every=4, tensorboard=tmp_path / "runs", file=io.StringIO()) as p:
        for x, y in _batches():
            loss = engine.step(x, y)
            losses[engine.global_step] = float(loss)
            p.update(loss)
        p.log(val_loss=0.5)
    events = EventAccumulator(str(tmp_path / "runs"))
    events.Reload()
    assert {"train/loss", "train/lr", "train/grad_norm", "train/samples_per_second", "train/val_loss"} <= set(
        events.Tags()["scalars"]
    )
    logged = {e.step: e.value for e in events.Scalars("train/loss")}
    assert sorted(logged) == [4, 8]
    for step, value in logged.items():
        assert value == pytest.approx(losses[step], rel=1e-6)  # event files keep float32
    assert [e.step for e in events.Scalars("train/val_loss")] == [8]


def test_tensorboard_without_the_package_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine()
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(epl.EplError, match=r"needs the tensorboard package: pip install tensorboard"):
        epl.Progress(engine, tensorboard="runs")


def test_only_rank_0_shows_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    engine, out = _engine(), io.StringIO()
    monkeypatch.setattr(engine.context, "cluster", dataclasses.replace(engine.context.cluster, rank=1, world_size=2))
    progress = epl.Progress(engine, total=STEPS, log_every=1, file=out)
    for x, y in _batches():
        progress.update(engine.step(x, y))
    progress.log(val_loss=1.0)
    progress.close()
    assert out.getvalue() == ""


def test_samples_and_tokens_of_a_batch() -> None:
    ids = torch.randint(0, 50, (4, 16))
    assert samples_and_tokens({"input_ids": ids, "labels": ids.clone()}) == (4, 64)
    assert samples_and_tokens((torch.randn(8, 3), torch.randn(8, 1))) == (8, None)
    assert samples_and_tokens((torch.randint(0, 9, (2, 5)), torch.randint(0, 9, (2, 5)))) == (2, 10)
    assert samples_and_tokens({"mask": torch.ones(3, 4, dtype=torch.bool)}) == (3, None)
    assert samples_and_tokens(None) == (None, None)


def test_the_engine_counts_the_last_steps_samples_and_tokens() -> None:
    engine = _engine()
    assert engine.last_step_samples is None and engine.last_step_tokens is None
    x, y = _batches()[0]
    engine.step(x, y)
    assert engine.last_step_samples == 6 and engine.last_step_tokens is None


def test_log_every_must_be_positive() -> None:
    with pytest.raises(ValueError, match="log_every must be at least 1"):
        epl.Progress(_engine(), log_every=0)
