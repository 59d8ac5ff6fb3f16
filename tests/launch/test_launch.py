"""`epl launch` on real processes: environment, arguments, output, failures, signals, MPI, two machines."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from epl.cli import make_cli
from epl.ports import free_port
from tests.launch.scripts import write

pytestmark = pytest.mark.multiprocess

BIN = Path(sys.executable).parent
EPL = shutil.which("epl", path=str(BIN)) or "epl"


@pytest.fixture
def out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    folder = tmp_path / "out"
    folder.mkdir()
    monkeypatch.setenv("TEST_OUT", str(folder))
    monkeypatch.setenv("PATH", f"{BIN}{os.pathsep}{os.environ['PATH']}")  # python3 of run.sh = this Python
    yield folder
    for record in folder.glob("rank*.json"):  # no orphans: every worker and grandchild is gone
        data = json.loads(record.read_text())
        for pid in (data["pid"], data["child"]):
            assert pid is None or not _alive(pid), f"process {pid} of {record.name} outlived the launch"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead; on Linux check its state
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split()[2] == "Z")


def launch(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [EPL, "launch", *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def records(folder: Path) -> dict[int, dict]:
    return {int(p.stem[4:].split(".")[0]): json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))}


def test_workers_get_the_launch_environment_and_the_arguments_untouched(tmp_path: Path, out: Path) -> None:
    scripts = write(tmp_path)
    done = launch("--nproc-per-node", "2", str(scripts["record"]), "--lr", "3e-4", "--name=x y", "-v")
    assert done.returncode == 0, done.stderr
    got = records(out)
    assert sorted(got) == [0, 1]
    for rank, record in got.items():
        assert record["argv"] == ["--lr", "3e-4", "--name=x y", "-v"]
        env = record["env"]
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (
            str(rank),
            "2",
            str(rank),
            "2",
        )
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0 and env["EPL_LAUNCHER"] == "epl"
        assert int(env["OMP_NUM_THREADS"]) >= 1
    assert "[rank 0] hello from rank 0" in done.stdout and "[rank 1] hello from rank 1" in done.stdout


def test_manual_flags_env_vars_shell_scripts_and_commands(tmp_path: Path, out: Path) -> None:
    scripts = write(tmp_path)
    assert launch("--num_workers", "1", "--gpu_per_worker", "2", str(scripts["run"]), "a").returncode == 0
    assert sorted(records(out)) == [0, 1] and records(out)[1]["argv"] == ["a"]
    for f in out.glob("*"):
        f.unlink()
    done = launch(sys.executable, str(scripts["record"]), "b", env={"EPL_LAUNCH_NPROC_PER_NODE": "3"})
    assert done.returncode == 0, done.stderr
    assert sorted(records(out)) == [0, 1, 2] and records(out)[2]["argv"] == ["b"]


def test_help_shows_every_flag_with_its_environment_variable() -> None:
    text = CliRunner().invoke(make_cli(), ["launch", "--help"]).output
    for flag, var in [
        ("--nproc-per-node", "EPL_LAUNCH_NPROC_PER_NODE"),
        ("--gpu_per_worker", "EPL_LAUNCH_NPROC_PER_NODE"),
        ("--num_workers", "EPL_LAUNCH_NUM_WORKERS"),
        ("--machine_rank", "EPL_LAUNCH_MACHINE_RANK"),
        ("--machine_list", "EPL_LAUNCH_MACHINE_LIST"),
        ("--master-addr", "EPL_LAUNCH_MASTER_ADDR"),
        ("--log-dir", "EPL_LAUNCH_LOG_DIR"),
    ]:
        assert flag in text and var in text


def test_each_rank_has_a_full_log(tmp_path: Path, out: Path) -> None:
    scripts = write(tmp_path)
    done = launch("--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"), str(scripts["record"]))
    assert done.returncode == 0
    assert (tmp_path / "logs" / "rank_1.log").read_text() == "hello from rank 1\n"


def test_a_failing_rank_ends_the_job_with_its_code(tmp_path: Path, out: Path) -> None:
    scripts = write(tmp_path)
    started = time.monotonic()
    done = launch(
        "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"), str(scripts["record"]), env={"TEST_MODE": "fail"}
    )
    assert done.returncode == 3
    assert time.monotonic() - started < 10 + 5  # 10 s for the job, a few for Python to start
    assert f"rank 1 exited with code 3; its log: {tmp_path / 'logs' / 'rank_1.log'}" in done.stderr


def test_a_rank_killed_by_a_signal_ends_the_job(tmp_path: Path, out: Path) -> None:
    scripts = write(tmp_path)
    done = launch("--nproc-per-node", "2", "--grace-period", "1", str(scripts["record"]), env={"TEST_MODE": "kill"})
    assert done.returncode == 128 + signal.SIGKILL
    assert "rank 1 was killed by SIGKILL" in done.stderr


def test_ctrl_c_ends_every_worker(tmp_path: Path, out: Path) -> None:
    launcher = _start_hanging(write(tmp_path), out, "hang")
    launcher.send_signal(signal.SIGINT)
    _, stderr = launcher.communicate(timeout=30)
    assert launcher.returncode == 130 and "SIGINT received; stopped every rank" in stderr


def test_errors_are_clear(tmp_path: Path) -> None:
    scripts = write(tmp_path)
    done = launch("--num-workers", "2", "--machine-rank", "2", "--master-port", "1234", str(scripts["record"]))
    assert done.returncode == 1 and "--machine-rank 2 is not in 0..1" in done.stderr
    done = launch("--num-workers", "2", str(scripts["record"]))
    assert done.returncode == 1 and "give every launcher the same --master-addr" in done.stderr
    done = launch("no-such-command-here")
    assert done.returncode != 0 and "cannot run 'no-such-command-here'" in done.stderr


MPIEXEC = shutil.which("mpiexec", path=str(BIN)) or shutil.which("mpiexec")


@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not installed (pip install mpi4py mpich)")
def test_mpi_launch(tmp_path: Path, out: Path) -> None:
    scripts = write(tmp_path)
    done = launch("--mpi", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"), str(scripts["record"]), "z")
    assert done.returncode == 0, done.stdout + done.stderr
    got = records(out)
    assert sorted(got) == [0, 1] and got[1]["argv"] == ["z"]
    assert got[1]["env"]["WORLD_SIZE"] == "2" and got[0]["env"]["EPL_LAUNCHER"] == "mpi"
    assert (tmp_path / "logs" / "rank_0.log").read_text() == "hello from rank 0\n"
    for f in out.glob("*"):
        f.unlink()
    done = launch("--mpi", "--nproc-per-node", "2", str(scripts["record"]), env={"TEST_MODE": "fail"})
    assert done.returncode == 3 and "rank 1 exited with code 3" in done.stderr


def test_two_machines_on_loopback_train_together(tmp_path: Path, out: Path) -> None:
    pytest.importorskip("epl_comm")
    scripts = write(tmp_path)
    port = str(free_port())
    common = ["--num-workers", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port]
    machines = [
        subprocess.Popen(
            [EPL, "launch", *common, "--machine-rank", str(rank), str(scripts["train"])],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    for machine in machines:
        _, stderr = machine.communicate(timeout=120)
        assert machine.returncode == 0, stderr
    assert [(out / f"train{r}.txt").read_text() for r in (0, 1)] == ["2 epl True"] * 2


def test_scripts_started_by_torchrun_work(tmp_path: Path, out: Path) -> None:
    pytest.importorskip("epl_comm")
    scripts = write(tmp_path)
    torchrun = shutil.which("torchrun", path=str(BIN)) or "torchrun"
    done = subprocess.run(
        [torchrun, "--nproc-per-node", "2", str(scripts["train"])], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert [(out / f"train{r}.txt").read_text() for r in (0, 1)] == ["2 torchrun True"] * 2


def test_the_epl_command_starts_without_importing_pytorch() -> None:
    probe = "import sys\nfrom epl.cli import make_cli\nmake_cli()\nprint('torch' in sys.modules)\n"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr


def test_machine_list_gives_workers_rank_and_master() -> None:
    from epl_launch.config import LaunchError, machine_from_list

    assert machine_from_list("127.0.0.1,203.0.113.7") == (2, 0, "127.0.0.1")
    assert machine_from_list("203.0.113.7, localhost") == (2, 1, "203.0.113.7")
    with pytest.raises(LaunchError, match="Cannot tell which of --machine-list"):
        machine_from_list("203.0.113.7,203.0.113.8")
    with pytest.raises(LaunchError, match="--machine-list is empty"):
        machine_from_list(" , ")


def test_machine_list_of_one_machine_launches(tmp_path: Path, out: Path) -> None:
    scripts = write(tmp_path)
    done = launch("--machine_list", "127.0.0.1", "--nproc-per-node", "2", str(scripts["record"]))
    assert done.returncode == 0, done.stderr
    assert sorted(records(out)) == [0, 1] and records(out)[0]["env"]["MASTER_ADDR"] == "127.0.0.1"


def test_the_rank_that_caused_a_failure_is_named_not_its_victim(tmp_path: Path, out: Path) -> None:
    scripts = write(tmp_path)
    logs = tmp_path / "logs"
    done = launch(
        "--nproc-per-node", "2", "--log-dir", str(logs), str(scripts["record"]), env={"TEST_MODE": "peer_lost"}
    )
    assert done.returncode == 3, done.stdout + done.stderr
    assert f"rank 1 exited with code 3; its log: {logs / 'rank_1.log'}" in done.stderr
    assert (logs / "rank_1.log").exists()


def _start_hanging(scripts: dict[str, Path], out: Path, mode: str, *flags: str) -> subprocess.Popen[str]:
    launcher = subprocess.Popen(
        [EPL, "launch", "--nproc-per-node", "2", *flags, str(scripts["record"])],
        env={**os.environ, "TEST_MODE": mode},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while len(list(out.glob("rank*.json"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    return launcher


def test_a_second_ctrl_c_during_the_grace_period_still_ends_every_worker(tmp_path: Path, out: Path) -> None:
    launcher = _start_hanging(write(tmp_path), out, "ignore_term", "--grace-period", "3")
    launcher.send_signal(signal.SIGINT)
    time.sleep(1)
    launcher.send_signal(signal.SIGINT)
    launcher.communicate(timeout=30)
    assert launcher.returncode == 130


def test_hangup_ends_every_worker(tmp_path: Path, out: Path) -> None:
    launcher = _start_hanging(write(tmp_path), out, "hang")
    launcher.send_signal(signal.SIGHUP)
    _, stderr = launcher.communicate(timeout=30)
    assert launcher.returncode == 128 + signal.SIGHUP and "SIGHUP received" in stderr


@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not installed (pip install mpi4py mpich)")
def test_mpi_launch_stops_on_ctrl_c_even_when_ranks_ignore_term(tmp_path: Path, out: Path) -> None:
    launcher = _start_hanging(write(tmp_path), out, "ignore_term", "--mpi", "--grace-period", "2")
    started = time.monotonic()
    launcher.send_signal(signal.SIGINT)
    _, stderr = launcher.communicate(timeout=60)
    assert launcher.returncode == 130 and "SIGINT received" in stderr
    assert time.monotonic() - started < 20


def test_logs_start_fresh_for_every_launch(tmp_path: Path, out: Path) -> None:
    scripts = write(tmp_path)
    for _ in range(2):
        done = launch("--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"), str(scripts["record"]))
        assert done.returncode == 0
    assert (tmp_path / "logs" / "rank_0.log").read_text() == "hello from rank 0\n"


def test_a_target_that_cannot_be_executed_is_a_clear_error(tmp_path: Path) -> None:
    target = tmp_path / "not-executable"
    target.write_text("echo hi\n")
    done = launch(str(target))
    assert done.returncode != 0 and "not executable" in done.stderr and "Traceback" not in done.stderr


def test_a_misspelt_option_names_the_closest_and_a_bad_master_address_names_its_flag() -> None:
    result = CliRunner().invoke(make_cli(), ["launch", "--nproc-per-nod", "2", "train.py"])
    assert result.exit_code == 2
    assert "No such option: --nproc-per-nod. Did you mean --nproc-per-node?" in result.output
    result = CliRunner().invoke(make_cli(), ["launch", "--master-addr", "no.such.host.invalid", "train.py"])
    assert result.exit_code == 1
    assert "--master-addr 'no.such.host.invalid': cannot resolve this address" in result.output


#: Data parallel with EPL; after one step rank 1 gets stuck outside any collective (TEST_MODE=stuck) or every rank
#: keeps computing without a word (TEST_MODE=busy).
STUCK = """
import os, time, torch, epl
from torch import nn
epl.init(epl.Config({"communication.timeout": 5}))
engine = epl.parallelize(nn.Linear(4, 4), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.MSELoss())
engine.step(torch.randn(8, 4), torch.randn(8, 4))
open(os.path.join(os.environ["TEST_OUT"], f"pid{os.environ['RANK']}"), "w").write(str(os.getpid()))
if os.environ["TEST_MODE"] == "busy" or os.environ["RANK"] == "1":
    while True:
        pass
for _ in range(10_000):
    engine.step(torch.randn(8, 4), torch.randn(8, 4))
"""


def test_the_launcher_names_the_rank_the_timeout_diagnosis_names(tmp_path: Path, out: Path) -> None:
    script = tmp_path / "stuck.py"
    script.write_text(STUCK)
    done = launch("--nproc-per-node", "2", str(script), env={"TEST_MODE": "stuck"}, timeout=90)
    assert done.returncode == 1
    assert "epl launch: rank 1 stopped taking part in collectives: rank 0's collective timed out" in done.stderr


def test_workers_end_when_the_launcher_is_killed(tmp_path: Path, out: Path) -> None:
    """SIGKILL cannot be passed on: the workers notice the launcher is gone and end within seconds."""
    script = tmp_path / "busy.py"
    script.write_text(STUCK)
    launcher = subprocess.Popen(
        [EPL, "launch", "--nproc-per-node", "2", str(script)],
        env={**os.environ, "TEST_MODE": "busy"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while len(list(out.glob("pid*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    workers = [int(path.read_text()) for path in out.glob("pid*")]
    assert len(workers) == 2, "the workers did not start"
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = [pid for pid in workers if _alive(pid)]
    for pid in survivors:  # never leave busy workers behind for the tests after this one
        os.kill(pid, signal.SIGKILL)
    assert not survivors, "workers kept running after their launcher died"


def test_a_module_runs_with_dash_m_and_standalone(tmp_path: Path, out: Path) -> None:
    """`epl launch --standalone -m package.module args` runs `python -m package.module args` on every rank."""
    scripts = write(tmp_path)
    package = tmp_path / "trainer"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "main.py").write_text(scripts["record"].read_text())
    done = subprocess.run(
        [EPL, "launch", "--standalone", "--nproc-per-node", "2", "-m", "trainer.main", "--lr", "1"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=os.environ,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    got = records(out)
    assert sorted(got) == [0, 1] and got[1]["argv"] == ["--lr", "1"]
    assert got[0]["env"]["MASTER_ADDR"] == "127.0.0.1"


def test_dash_m_and_standalone_errors_are_clear(tmp_path: Path) -> None:
    result = CliRunner().invoke(make_cli(), ["launch", "-m", "no_such_package_here.train"])
    assert result.exit_code == 1 and "-m no_such_package_here.train: no module 'no_such_package_here.train'" in (
        result.output
    )
    result = CliRunner().invoke(make_cli(), ["launch", "--standalone", "--num-workers", "2", "train.py"])
    assert result.exit_code == 1 and "--standalone runs on this machine alone" in result.output
    assert "--num-workers" in result.output


def test_one_launcher_per_node_under_srun(tmp_path: Path, out: Path) -> None:
    """`srun --ntasks-per-node 1 epl launch --nproc-per-node 1 train.py` on 2 nodes (simulated on loopback): each
    launcher takes its machine rank, the machine count and rank 0's host from Slurm's variables."""
    pytest.importorskip("epl_comm")
    scripts = write(tmp_path)
    slurm = {
        "SLURM_JOB_ID": "4242", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_NODES": "2",
        "SLURM_NNODES": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_STEP_NODELIST": "127.0.0.1,127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }  # fmt: skip
    machines = [
        subprocess.Popen(
            [EPL, "launch", "--nproc-per-node", "1", str(scripts["train"])],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **slurm, "SLURM_PROCID": str(node), "SLURM_NODEID": str(node), "SLURM_LOCALID": "0"},
        )  # fmt: skip
        for node in (0, 1)
    ]
    for machine in machines:
        _, stderr = machine.communicate(timeout=120)
        assert machine.returncode == 0, stderr
    assert [(out / f"train{r}.txt").read_text() for r in (0, 1)] == ["2 epl True"] * 2
