"""Every example under examples/ runs at a tiny size: on 2 processes with `epl launch`, and as one plain process.

Each run must exit with 0 and end with its summary (layout, memory of every rank,
throughput). The sizes are the smallest that still exercise the example's parallelism.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
BIN = Path(sys.executable).parent
EPL = shutil.which("epl", path=str(BIN)) or "epl"

#: Tiny arguments per example (the defaults are for people; these finish in seconds).
TINY = {
    "resnet_dp": ["--steps", "3", "--batch-size", "4", "--width", "4", "--blocks", "1", "--image-size", "8"]
    + ["--samples", "32"],
    "bert_pipeline": ["--steps", "3", "--batch-size", "8", "--layers", "2", "--hidden", "16", "--heads", "2"]
    + ["--seq-len", "8", "--vocab", "64", "--samples", "64"],
    "moe_transformer": ["--steps", "3", "--batch-size", "4", "--layers", "1", "--hidden", "16", "--heads", "2"]
    + ["--experts", "2", "--seq-len", "8", "--vocab", "32", "--samples", "32"],
    "model_parallel_by_hand": ["--steps", "3", "--batch-size", "8", "--samples", "64"],
}

#: What the layout line says on 2 processes.
LAYOUT_ON_2 = {
    "resnet_dp": "2 processes = 2 replicas x 1 device(s)",
    "bert_pipeline": "2 processes = 1 replica x 2 device(s), a 2-stage pipeline, 4 micro-batches",
    "moe_transformer": "2 processes = 1 replica x 2 device(s), TaskGraphs colocated on the same devices",
    "model_parallel_by_hand": "2 processes = 1 replica x 2 device(s), a 2-stage pipeline, 4 micro-batches",
}

#: Extra flags of the 2-process run (the memory techniques of the data-parallel example).
FLAGS_ON_2 = {"resnet_dp": ["--checkpointing", "--amp", "--zero", "v1"]}

SUMMARY = re.compile(r"throughput: [\d.]+ samples/s \(global batch \d+, 3 steps\), final loss [\d.]+")


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}


def _check(done: subprocess.CompletedProcess[str], name: str) -> str:
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert f"== {name} summary ==" in done.stdout, output[-4000:]
    assert SUMMARY.search(done.stdout), output[-4000:]
    return done.stdout


def test_every_example_has_a_readme_with_its_launch_command_and_a_tiny_run() -> None:
    found = sorted(p.parent.name for p in EXAMPLES.glob("*/train.py"))
    assert set(TINY) <= set(found)
    for name in found:
        readme = (EXAMPLES / name / "README.md").read_text()
        assert f"epl launch --nproc-per-node 2 examples/{name}/train.py" in readme
        assert f"python examples/{name}/train.py" in readme


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(TINY))
def test_example_on_two_processes(name: str) -> None:
    script = EXAMPLES / name / "train.py"
    done = subprocess.run(
        [EPL, "launch", "--nproc-per-node", "2", str(script), *TINY[name], *FLAGS_ON_2.get(name, [])],
        capture_output=True,
        text=True,
        timeout=150,
        env=_env(),
        cwd=ROOT,
    )
    stdout = _check(done, name)
    assert LAYOUT_ON_2[name] in stdout, stdout
    for rank in (0, 1):  # every rank's memory, printed by rank 0
        assert f"[rank 0] memory:     rank {rank}: parameters" in stdout, stdout
    assert "[rank 1] step" not in stdout  # progress on rank 0 only


@pytest.mark.parametrize("name", sorted(TINY))
def test_example_in_one_process(name: str) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name / "train.py"), *TINY[name]],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
        cwd=ROOT,
    )
    stdout = _check(done, name)
    assert "layout:     1 process runs every TaskGraph" in stdout
    assert len(re.findall(r"^step 3/3 \(100%\)  loss [\d.]+ .*samples/s [\d.]+k? .*elapsed ", stdout, re.M)) == 1


@pytest.mark.multiprocess
@pytest.mark.parametrize(("name", "last_line"), [("quickstart", "Train Finished."), ("pipeline", "step 20/20 (100%)")])
def test_the_manual_examples_print_from_rank_0_only(name: str, last_line: str) -> None:
    done = subprocess.run(
        [EPL, "launch", "--nproc-per-node", "2", str(EXAMPLES / name / "train.py")],
        capture_output=True,
        text=True,
        timeout=150,
        env=_env(),
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert last_line in done.stdout
    assert {line.split("]")[0] for line in done.stdout.splitlines()} == {"[rank 0"}
