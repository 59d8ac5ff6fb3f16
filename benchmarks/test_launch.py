"""Time from `epl launch` to every rank joined and through a barrier, against torchrun (same world size).

Target: EPL / torchrun <= 1.0.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.harness import ResultRow, Section, compare, record, short_mode

pytestmark = pytest.mark.multiprocess

BIN = Path(sys.executable).parent
READY = "import epl\nenv = epl.init()\nenv.communicator.barrier().wait()\n"
MAX_RATIO = 1.5 if short_mode() else 1.10
SECTION = Section(
    "Launch",
    __file__,
    "Wall time from the command to 2 ranks joined and through a barrier (`epl.init()` + barrier), "
    "`epl launch` over `torchrun`. Target <= 1.0.",
)


def test_launch_to_ready_against_torchrun(tmp_path: Path) -> None:
    pytest.importorskip("epl_comm")
    script = tmp_path / "ready.py"
    script.write_text(READY)
    epl = shutil.which("epl", path=str(BIN)) or "epl"
    torchrun = shutil.which("torchrun", path=str(BIN)) or "torchrun"

    def run(command: list[str]) -> None:
        subprocess.run(command, check=True, capture_output=True, timeout=120)

    result = compare(
        "launch_to_ready_vs_torchrun",
        lambda: run([torchrun, "--nproc-per-node", "2", str(script)]),
        lambda: run([epl, "launch", "--nproc-per-node", "2", str(script)]),
        rounds=1 if short_mode() else 6,
        calls_per_round=1,
        warmup=0 if short_mode() else 1,  # short mode only keeps the benchmark from rotting
    )
    row = ResultRow("`epl launch` to 2 ranks ready", "`torchrun`", plot="epl launch vs torchrun")
    detail = (
        f"torchrun {result.baseline_s:.2f} s, epl launch {result.epl_s:.2f} s, ratio {result.ratio:.3f} "
        f"(median of {result.rounds} rounds)"
    )
    record("launch_to_ready_vs_torchrun", [result.row(row)], section=SECTION, details=[detail])
    assert result.ratio < MAX_RATIO, result.line()
