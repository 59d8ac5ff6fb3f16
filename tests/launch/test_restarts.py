"""`epl launch --max-restarts`: a job that fails once finishes from its checkpoint, equal to one that never failed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch.scripts import write

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[2]
EPL = shutil.which("epl", path=str(Path(sys.executable).parent)) or "epl"
EXAMPLE = ROOT / "examples" / "resume" / "train.py"


def _launch(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [EPL, "launch", "--nproc-per-node", "2", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def test_a_job_that_fails_once_finishes_from_its_checkpoint(tmp_path: Path) -> None:
    clean = _launch(str(EXAMPLE), "--checkpoint", str(tmp_path / "a"), "--result", str(tmp_path / "a.json"))
    assert clean.returncode == 0, clean.stdout + clean.stderr
    failed = _launch(
        "--max-restarts", "2", "--log-dir", str(tmp_path / "logs"), str(EXAMPLE),
        "--checkpoint", str(tmp_path / "b"), "--result", str(tmp_path / "b.json"), "--fail-once-at", "7",
    )  # fmt: skip
    assert failed.returncode == 0, failed.stdout + failed.stderr
    assert "rank 1 exited with code 1" in failed.stderr and "Restarting every rank: restart 1 of 2." in failed.stderr
    assert "a simulated crash at step 7" in failed.stdout
    expected, got = json.loads((tmp_path / "a.json").read_text()), json.loads((tmp_path / "b.json").read_text())
    assert got["restart"] == 1
    assert got["weights"] == expected["weights"]  # bit for bit: weights, AdamW, the LR schedule, data order
    assert got["losses"] == expected["losses"][6:]  # resumed from the checkpoint of step 6
    log = (tmp_path / "logs" / "rank_1.log").read_text()
    assert "a simulated crash at step 7" in log and "== epl launch: restart 1 ==" in log  # both starts kept


def test_restarts_give_up_after_max_restarts(tmp_path: Path) -> None:
    scripts = write(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    done = _launch(
        "--max-restarts",
        "1",
        "--grace-period",
        "1",
        str(scripts["record"]),
        env={"TEST_OUT": str(out), "TEST_MODE": "fail"},
    )
    assert done.returncode == 3, done.stderr
    assert "Restarting every rank: restart 1 of 1." in done.stderr
    assert "rank 1 exited with code 3" in done.stderr.splitlines()[-1]
    assert "Gave up after 1 restart(s) (--max-restarts 1)." in done.stderr
    assert done.stdout.count("[rank 1] hello from rank 1") == 2  # started twice


def test_workers_are_told_which_start_they_are_in() -> None:
    shown = subprocess.run(
        [EPL, "launch", "--nproc-per-node", "1", "--max-restarts", "3", sys.executable, "-c",
         "import os; print(os.environ['EPL_RESTART_COUNT'], os.environ['TORCHELASTIC_MAX_RESTARTS'])"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert "[rank 0] 0 3" in shown.stdout
