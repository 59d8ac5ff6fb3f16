"""The cluster as MPI reports it, under a real ``mpiexec`` (the mpich wheel of PyPI)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

#: The mpiexec of this environment (the mpich wheel puts it beside python), else the PATH's.
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not installed (pip install mpi4py mpich)"),
]

SCRIPT = """
import json, os, sys, epl
from epl.interfaces.cluster import Cluster
exported = Cluster.from_environ(cuda_available=False)
local_vars = ("MPI_LOCALRANKID", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")
asked = Cluster.from_environ({k: v for k, v in os.environ.items() if k not in local_vars}, cuda_available=False)
try:
    epl.init()
    outcome = "initialised"
except epl.MissingPluginError as exc:
    outcome = str(exc)
row = [exported.rank, exported.world_size, exported.local_rank, exported.launcher,
       asked.rank, asked.local_rank, asked.local_world_size, outcome]
with open(os.path.join(sys.argv[1], f"rank{exported.rank}.json"), "w") as file:
    json.dump(row, file)
"""


def mpiexec(tmp_path: Path, processes: int) -> list[list[object]]:
    script = tmp_path / "read_cluster.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    done = subprocess.run(
        [str(MPIEXEC), "-n", str(processes), sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "OMP_NUM_THREADS": "1", "EPL_DISABLE_EXTERNAL_PLUGINS": "1"},  # epl-core alone
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(processes)]


def test_ranks_under_mpiexec_from_variables_and_from_mpi4py(tmp_path: Path) -> None:
    rows = mpiexec(tmp_path, 2)
    assert [row[:7] for row in rows] == [[0, 2, 0, "mpi", 0, 0, 2], [1, 2, 1, "mpi", 1, 1, 2]]
    assert all("can join 2 processes" in row[7] for row in rows)


def test_single_process_under_mpiexec_is_a_local_run(tmp_path: Path) -> None:
    (row,) = mpiexec(tmp_path, 1)
    assert row == [0, 1, 0, "mpi", 0, 0, 1, "initialised"]


def test_plain_mpiexec_job_trains_data_parallel_with_the_address_shared_over_mpi(tmp_path: Path) -> None:
    pytest.importorskip("epl_comm")
    from tests.launch.scripts import write

    scripts = write(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run(
        [str(MPIEXEC), "-n", "2", sys.executable, str(scripts["train"])],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "OMP_NUM_THREADS": "1", "TEST_OUT": str(tmp_path)},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert [(tmp_path / f"train{r}.txt").read_text() for r in range(2)] == ["2 mpi True"] * 2


FAILING = """
import sys, torch, epl
from torch import nn
epl.init(epl.Config({"communication.timeout": 5}))
engine = epl.parallelize(nn.Linear(4, 4), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.MSELoss())
engine.step(torch.randn(8, 4), torch.randn(8, 4))
if epl.Env.get().cluster.rank == 1:
    if sys.argv[1] == "raise":
        raise RuntimeError("rank 1 broke")
    while True:  # stuck without a collective
        pass
for _ in range(10_000):
    engine.step(torch.randn(8, 4), torch.randn(8, 4))
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("failure", ["raise", "hang"])
def test_plain_mpiexec_ends_the_whole_job_when_a_rank_fails(tmp_path: Path, failure: str) -> None:
    """Without EPL's hook a raising rank waits in MPI_Finalize and the others wait for it until the timeout; a
    stuck rank kept the job alive forever. Now: the traceback names the rank, and mpiexec ends every process."""
    import time

    pytest.importorskip("epl_comm")
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    started = time.monotonic()
    done = subprocess.run(
        [str(MPIEXEC), "-n", "2", sys.executable, str(script), failure],
        capture_output=True,
        text=True,
        timeout=80,
        env={**env, "OMP_NUM_THREADS": "1"},
    )
    seconds = time.monotonic() - started
    output = done.stdout + done.stderr
    assert done.returncode != 0
    if failure == "raise":
        assert "[epl] rank 1 failed; ending the MPI job." in output and "RuntimeError: rank 1 broke" in output
        assert seconds < 30, seconds
    else:  # rank 0's collective times out after 5 s naming rank 1, which ends the job
        assert "[epl] rank 0 failed; ending the MPI job." in output and "ranks [1] did not arrive" in output
        assert seconds < 10 + 30, seconds
    assert str(script) not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
