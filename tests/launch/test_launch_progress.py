"""epl.Progress under `epl launch`: plain lines from rank 0 only in a pipe, a bar passed through to a terminal."""

from __future__ import annotations

import io
import os
import pty
import re
import select
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from epl_launch.output import CLEAR_LINE, RankOutput

pytestmark = pytest.mark.multiprocess

EPL = shutil.which("epl", path=str(Path(sys.executable).parent)) or "epl"
STEPS = 6

#: Two replicas of a linear model fed by epl.io.data_loader, with a Progress; every rank checks the engine's counts.
TRAIN = textwrap.dedent(
    f"""
    import sys
    import torch
    from torch import nn
    import epl

    epl.init(epl.Config({{"optimizer.max_grad_norm": 1.0}}))
    torch.manual_seed(0)
    engine = epl.parallelize(nn.Linear(4, 1), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.MSELoss())
    data = torch.utils.data.TensorDataset(torch.randn(48, 4), torch.randn(48, 1))
    loader = epl.io.data_loader(data, batch_size=4, engine=engine, shuffle=False)
    with epl.Progress(engine, total={STEPS}, log_every=2, refresh_seconds=0) as progress:
        for x, y in loader:
            progress.update(engine.step(x, y))
            assert engine.last_step_samples == 8, engine.last_step_samples
    sys.stdout.write(f"rank {{epl.Env.get().cluster.rank}} done\\n")  # one write: the ranks share torchrun's pipe
    sys.stdout.flush()
    """
)


def _script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(TRAIN)
    return path


def test_plain_lines_come_from_rank_0_only(tmp_path: Path) -> None:
    done = subprocess.run(
        [EPL, "launch", "--nproc-per-node", "2", str(_script(tmp_path))],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    steps = re.findall(
        r"^\[rank (\d)\] step (\d)/6 \(\d+%\)  loss \d\.\d{4}  lr 1\.00e-01  grad_norm", done.stdout, re.M
    )
    assert steps == [("0", "2"), ("0", "4"), ("0", "6")]
    assert "\r" not in done.stdout
    assert "[rank 0] rank 0 done" in done.stdout and "[rank 1] rank 1 done" in done.stdout


def test_under_torchrun_too(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(_script(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.findall(r"^step (\d)/6 ", done.stdout, re.M) == ["2", "4", "6"], done.stdout + done.stderr
    assert sorted(re.findall(r"rank (\d) done", done.stdout + done.stderr)) == ["0", "1"], done.stdout + done.stderr


def test_a_terminal_gets_rank_0s_bar_in_place(tmp_path: Path) -> None:
    controller, terminal = pty.openpty()
    job = subprocess.Popen(
        [EPL, "launch", "--nproc-per-node", "2", str(_script(tmp_path))],
        stdin=subprocess.DEVNULL,
        stdout=terminal,
        stderr=terminal,
        env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"},
    )
    os.close(terminal)
    shown = _read_all(controller, job, timeout=120)
    assert job.returncode == 0, shown
    assert CLEAR_LINE + "[rank 0] train:" in shown  # redrawn in place
    assert re.search(r"\[rank 0\] train: 100%\|[^|]+\| 6/6 \[.*loss \d\.\d{4}.*\]\r?\n", shown)  # its last state stays
    assert "[rank 1] train" not in shown
    assert "[rank 1] rank 1 done" in shown


def _read_all(fd: int, job: subprocess.Popen[bytes], timeout: float) -> str:
    """Everything written to the terminal whose controlling side is ``fd`` until ``job`` ends."""
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                data = os.read(fd, 65536)
            except OSError:  # the terminal closed: every writer ended
                break
            if not data:
                break
            chunks.append(data)
        elif job.poll() is not None:
            break
    job.wait(timeout=10)
    os.close(fd)
    return b"".join(chunks).decode(errors="replace")


def test_output_keeps_whole_lines_and_shows_redraws_as_a_status_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    screen = io.StringIO()
    monkeypatch.setattr(sys, "stdout", screen)
    output = RankOutput(tmp_path / "logs", range(2), terminal=True)
    read, write = os.pipe()
    follower = output.follow(0, os.fdopen(read, "rb"))
    os.write(write, b"start\n\rbar 1")
    _wait_for(lambda: "bar 1" in screen.getvalue())
    output.line(1, b"rank 1 speaks\n")  # another rank's line: the bar is cleared, then drawn again
    os.write(write, b"\rbar 2\rbar 3\nend")
    os.close(write)
    follower.join(timeout=10)
    output.close()
    assert screen.getvalue() == (
        "[rank 0] start\n"
        f"{CLEAR_LINE}[rank 0] bar 1"
        f"{CLEAR_LINE}[rank 1] rank 1 speaks\n[rank 0] bar 1"
        f"{CLEAR_LINE}[rank 0] bar 3\n"
        "[rank 0] end\n"
    )
    assert (tmp_path / "logs" / "rank_0.log").read_text() == "start\nbar 3\nend\n"


def _wait_for(condition, timeout: float = 10) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_not_a_terminal_gets_whole_lines_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    screen = io.StringIO()
    monkeypatch.setattr(sys, "stdout", screen)
    output = RankOutput(None, range(1), terminal=False)
    read, write = os.pipe()
    follower = output.follow(0, os.fdopen(read, "rb"))
    writer = threading.Thread(target=lambda: (os.write(write, b"\rbar 1\rbar 2\n"), os.close(write)))
    writer.start()
    writer.join()
    follower.join(timeout=10)
    assert screen.getvalue() == "[rank 0] bar 2\n"
