"""`epl launch` shows a failed job's error once, naming the ranks that raised it and their logs; each rank's log keeps
the whole traceback; a traceback a rank caught and printed is still shown; the live output stays."""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from epl_launch.output import RankOutput
from epl_launch.tracebacks import error_of, failed_lines

BIN = Path(sys.executable).parent
EPL = shutil.which("epl", path=str(BIN)) or "epl"

#: Rank 1 raises an EplError three calls deep after a data-parallel step; rank 0 then loses it in its next step.
RAISES_ON_RANK_1 = """
import os, torch, epl
from torch import nn
epl.init()
engine = epl.parallelize(nn.Linear(4, 4), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.MSELoss())
engine.step(torch.randn(8, 4), torch.randn(8, 4))
print("step done", flush=True)

def check(batch):
    inspect(batch)

def inspect(batch):
    raise epl.EplError("the batch has 3 columns: give it 4")

if os.environ["RANK"] == "1":
    check(None)
engine.step(torch.randn(8, 4), torch.randn(8, 4))
"""

#: Every rank raises the same error (no EPL: the launcher reads any Python traceback).
RAISES_EVERYWHERE = """
print("hello", flush=True)
raise ValueError("bad value on every rank")
"""

#: Rank 0 catches an error and prints its traceback, then goes on and succeeds.
CAUGHT = """
import os, traceback
try:
    raise KeyError("missing")
except KeyError:
    traceback.print_exc()
print(f"went on {os.environ['RANK']}", flush=True)
"""


def launch(script: Path, *flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [EPL, "launch", "--nproc-per-node", "2", *flags, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


@pytest.mark.multiprocess
def test_a_rank_that_raises_is_named_with_its_error_once_and_its_log_keeps_the_traceback(tmp_path: Path) -> None:
    script, logs = tmp_path / "raises.py", tmp_path / "logs"
    script.write_text(RAISES_ON_RANK_1)
    started = time.monotonic()
    done = launch(script, "--log-dir", str(logs))
    took, output = time.monotonic() - started, done.stdout + done.stderr
    assert done.returncode == 1, output
    assert took < 30, f"the job took {took:.0f} s to end"
    assert "[rank 0] step done" in done.stdout and "[rank 1] step done" in done.stdout  # live output stays
    assert output.count("the batch has 3 columns") == 1, output
    assert done.stderr.splitlines() == [
        "epl launch: rank 1 failed: EplError: the batch has 3 columns: give it 4",
        f"epl launch: rank 1 exited with code 1; its log: {logs / 'rank_1.log'}. Stopped the other ranks.",
    ], output
    assert "Traceback" not in output and "went away" not in output  # neither the traceback nor rank 0's echo of it
    log = (logs / "rank_1.log").read_text()
    assert log.startswith("step done\nTraceback (most recent call last):\n"), log
    assert "in check" in log and 'raise epl.EplError("the batch has 3 columns: give it 4")' in log
    assert log.rstrip().endswith("epl.errors.EplError: the batch has 3 columns: give it 4")
    assert "[rank1]" not in log  # Python's traceback, without torch.distributed's prefix on every line
    assert "went away" in (logs / "rank_0.log").read_text()  # rank 0's own consequence stays in its log


@pytest.mark.multiprocess
def test_ranks_that_raise_the_same_error_are_named_together_and_a_temporary_log_is_kept(tmp_path: Path) -> None:
    script, temporary = tmp_path / "everywhere.py", tmp_path / "tmp"
    script.write_text(RAISES_EVERYWHERE)
    temporary.mkdir()
    done = launch(script, env={"TMPDIR": str(temporary)})  # no --log-dir: logs in a temporary folder
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert output.count("bad value on every rank") == 1 and "Traceback" not in output, output
    assert "epl launch: ranks 0, 1 failed: ValueError: bad value on every rank\n" in done.stderr, output
    named = re.search(r"its log: (\S+rank_(\d)\.log) \(rank (\d)'s: (\S+rank_\d\.log)\)", done.stderr)
    assert named is not None and {named[2], named[3]} == {"0", "1"}, output
    for path in (named[1], named[4]):  # kept after the failure, with the whole traceback
        assert Path(path).parent.parent == temporary
        assert 'raise ValueError("bad value on every rank")' in Path(path).read_text()

    caught = tmp_path / "caught.py"
    caught.write_text(CAUGHT)
    shutil.rmtree(Path(named[1]).parent)
    done = launch(caught, env={"TMPDIR": str(temporary)})
    assert done.returncode == 0, done.stdout + done.stderr
    rank_0 = [line for line in done.stdout.splitlines() if line.startswith("[rank 0] ")]
    assert rank_0[0] == "[rank 0] Traceback (most recent call last):" and "[rank 0] KeyError: 'missing'" in rank_0
    assert rank_0[-1] == "[rank 0] went on 0", rank_0  # shown in order, the traceback before what followed it
    assert list(temporary.iterdir()) == []  # a job that succeeded leaves no temporary log behind


def test_a_held_traceback_is_shown_once_its_rank_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    shown = io.StringIO()
    monkeypatch.setattr(sys, "stdout", shown)
    output = RankOutput(None, range(2), terminal=False)
    for line in ["before", "Traceback (most recent call last):", '  File "x.py", line 1', "KeyError: 'k'", "after"]:
        output.line(0, f"{line}\n".encode())
    output.line(1, b"rank 1 goes on\n")
    assert shown.getvalue() == "[rank 0] before\n[rank 1] rank 1 goes on\n"  # held while rank 0 may be ending
    output.release(age=60)
    assert "KeyError" not in shown.getvalue()
    output.release(age=0)  # the launcher's watch: rank 0 still runs after HOLD_SECONDS
    assert shown.getvalue().endswith("[rank 0] KeyError: 'k'\n[rank 0] after\n")
    output.line(0, b"later\n")
    assert shown.getvalue().endswith("[rank 0] later\n")
    assert output.tracebacks[0][0] == "Traceback (most recent call last):"
    output.close()


def test_the_error_is_read_from_any_traceback() -> None:
    chained = [
        "[rank1]: Traceback (most recent call last):",
        '[rank1]:   File "a.py", line 3, in <module>',
        "[rank1]: KeyError: 'x'",
        "",
        "[rank1]: The above exception was the direct cause of the following exception:",
        "",
        "[rank1]: Traceback (most recent call last):",
        '[rank1]:   File "a.py", line 5, in <module>',
        "[rank1]:     raise Oops",
        "[rank1]:     ^^^^^^^^^^",
        "[rank1]: epl_comm.diagnostics.CollectiveTimeoutError: all_reduce #3 timed out",
        "[rank1]: ranks [0] did not arrive",
        "",
        "unrelated output after it",
    ]
    assert error_of(chained) == "CollectiveTimeoutError: all_reduce #3 timed out\nranks [0] did not arrive"
    exiting = ["Traceback (most recent call last):", "RuntimeError: boom", "[W1023 10:11:12.345] ProcessGroupNCCL: ..."]
    assert error_of(exiting) == "RuntimeError: boom"  # a log record printed at exit is not part of the message
    assert error_of(["no traceback here"]) is None
    assert error_of(["Traceback (most recent call last):", '  File "a.py", line 1']) is None  # cut short
    assert failed_lines({0: "E: a", 1: "E: b\nmore", 2: "E: a", 3: None}) == [
        "epl launch: ranks 0, 2 failed: E: a",
        "epl launch: rank 1 failed: E: b\n    more",
    ]
