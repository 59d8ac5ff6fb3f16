"""The ``epl launch`` click command: flags (torchrun's kebab-case and the manual's snake_case) to a LaunchConfig."""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from epl.plugin_api import free_port, slurm_step
from epl_launch.config import LaunchConfig, LaunchError, default_nproc_per_node, machine_from_list
from epl_launch.local import LocalJob, Outcome, report
from epl_launch.mpi import run_mpi
from epl_launch.restarts import run_with_restarts

_F = TypeVar("_F", bound=Callable[..., Any])


def _option(*names: str, env: str, **kwargs: Any) -> Callable[[_F], _F]:
    return click.option(*names, envvar=f"EPL_LAUNCH_{env}", show_envvar=True, **kwargs)


@click.command(
    "launch",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@_option(
    "--nproc-per-node",
    "--nproc_per_node",
    "--gpu-per-worker",
    "--gpu_per_worker",
    "nproc_per_node",
    env="NPROC_PER_NODE",
    type=click.IntRange(min=1),
    default=None,
    help="Processes on this machine, one per device [default: one per GPU, else 1].",
)
@_option(
    "--num-workers",
    "--num_workers",
    "--nnodes",
    "num_workers",
    env="NUM_WORKERS",
    type=click.IntRange(min=1),
    default=None,
    help="Machines in the job (one launcher on each) [default: 1].",
)
@_option(
    "--machine-rank",
    "--machine_rank",
    "--node-rank",
    "--node_rank",
    "machine_rank",
    env="MACHINE_RANK",
    type=click.IntRange(min=0),
    default=None,
    help="This machine's index, 0 .. num-workers - 1 [default: 0].",
)
@_option(
    "--machine-list",
    "--machine_list",
    "machine_list",
    env="MACHINE_LIST",
    default=None,
    help="Every machine's address, comma-separated, machine 0 first (sets --num-workers, --master-addr "
    "and, by matching this machine's names, --machine-rank).",
)
@_option(
    "--master-addr",
    "--master_addr",
    "master_addr",
    env="MASTER_ADDR",
    default=None,
    help="Address of machine 0, where the rendezvous listens [default: 127.0.0.1, loopback].",
)
@_option(
    "--master-port",
    "--master_port",
    "master_port",
    env="MASTER_PORT",
    type=click.IntRange(1, 65535),
    default=None,
    help="Rendezvous port [default on one machine: a free port; required on several].",
)
@_option(
    "--log-dir",
    "--log_dir",
    "log_dir",
    env="LOG_DIR",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Keep each rank's full output in LOG_DIR/rank_N.log [default: a temporary folder, deleted when the job "
    "succeeds].",
)
@_option("--mpi", "mpi", env="MPI", is_flag=True, help="Start the processes with mpiexec.")
@_option(
    "-m",
    "--module",
    "module",
    env="MODULE",
    is_flag=True,
    help="TARGET is a Python module, run as python -m TARGET (as torchrun -m).",
)
@_option(
    "--standalone",
    "standalone",
    env="STANDALONE",
    is_flag=True,
    help="One machine, a rendezvous on loopback at a free port (the default on one machine; as torchrun "
    "--standalone, it refuses the options of several machines).",
)
@_option(
    "--max-restarts",
    "--max_restarts",
    "max_restarts",
    env="MAX_RESTARTS",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Start the whole job again after a rank fails, at most this many times (as torchrun); the script "
    "resumes from its last checkpoint. EPL_RESTART_COUNT tells it which start it is.",
)
@_option(
    "--grace-period",
    "--grace_period",
    "grace_period",
    env="GRACE_PERIOD",
    type=click.FloatRange(min=0),
    default=5.0,
    show_default=True,
    help="Seconds between TERM and KILL when stopping ranks.",
)
@click.argument("target")
@click.argument("target_args", nargs=-1, type=click.UNPROCESSED)
def launch_command(
    nproc_per_node: int | None,
    num_workers: int | None,
    machine_rank: int | None,
    machine_list: str | None,
    master_addr: str | None,
    master_port: int | None,
    log_dir: Path | None,
    mpi: bool,
    module: bool,
    standalone: bool,
    max_restarts: int,
    grace_period: float,
    target: str,
    target_args: tuple[str, ...],
) -> None:
    """Start TARGET on every process of the job with what epl.init needs.

    TARGET is a Python file, a shell script (the manual's run.sh) or any command;
    the arguments after it are passed to it untouched. Each rank's output is shown
    live with a [rank N] prefix and kept whole in its log. When a rank fails, the
    others are stopped, its error is shown once with its log, and the launcher exits
    with the failing rank's code.

    \b
    Examples:
      epl launch --nproc-per-node 4 train.py --lr 3e-4
      epl launch --standalone --nproc-per-node 2 -m mypackage.train --epochs 3
      epl launch --nproc-per-node 4 --max-restarts 3 train.py   # resumes from its checkpoint
      epl launch --num_workers 1 --gpu_per_worker 2 run.sh
      epl launch --num-workers 2 --machine-rank 1 --master-addr 10.0.0.1 --master-port 29500 train.py
    """
    if target.startswith("-"):
        raise click.UsageError(_unknown_option(target))
    try:
        if standalone:
            _check_standalone(num_workers, machine_rank, machine_list, master_addr)
        if module:
            _check_module(target)
        step = slurm_step(os.environ)
        if step is not None and step.world_size == step.num_nodes > 1 and num_workers is None:
            # srun --ntasks-per-node 1 epl launch ...: one launcher per node of the allocation
            num_workers, machine_rank = step.num_nodes, step.node_rank if machine_rank is None else machine_rank
            master_addr, master_port = master_addr or step.master_addr, master_port or step.master_port
        if machine_list is not None:
            listed_workers, listed_rank, listed_master = machine_from_list(machine_list)
            num_workers = num_workers or listed_workers
            machine_rank = listed_rank if machine_rank is None else machine_rank
            master_addr = master_addr or listed_master
        config = LaunchConfig(
            nproc_per_node=nproc_per_node or default_nproc_per_node(),
            num_workers=num_workers or 1,
            machine_rank=machine_rank or 0,
            master_addr=master_addr or "127.0.0.1",
            master_port=master_port,
            log_dir=log_dir,
            mpi=mpi,
            module=module,
            max_restarts=max_restarts,
            grace_period=grace_period,
            target=target,
            target_args=target_args,
        )
        _check_address(config.master_addr)
        port = config.master_port or free_port(config.master_addr)
    except (LaunchError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    temporary = None
    if log_dir is None:  # every rank's log all the same: a failure's message names the failed rank's
        temporary = Path(tempfile.mkdtemp(prefix="epl-launch-logs-"))
        config = dataclasses.replace(config, log_dir=temporary)

    def start(restart: int, port: int) -> Outcome:
        return run_mpi(config, port, restart) if config.mpi else LocalJob(config, port, restart).run()

    outcome: Outcome | None = None
    try:
        outcome = run_with_restarts(config, port, start)
    finally:
        if temporary is not None and (outcome is None or outcome.exit_code == 0 or outcome.interrupted):
            shutil.rmtree(temporary, ignore_errors=True)  # kept after a failure: its message names the logs
    sys.exit(report(outcome))


def _unknown_option(option: str) -> str:
    """The error for an option ``epl launch`` does not have, with the closest one it has."""
    import difflib

    names = [name for param in launch_command.params for name in param.opts if name.startswith("--")]
    close = difflib.get_close_matches(option.split("=", 1)[0], names, n=1)
    hint = f" Did you mean {close[0]}?" if close else ""
    return f"No such option: {option}.{hint} Options of epl launch go before the script (see epl launch --help)."


def _check_standalone(
    num_workers: int | None, machine_rank: int | None, machine_list: str | None, master_addr: str | None
) -> None:
    """Refuse ``--standalone`` with the options of a job of several machines."""
    given = [
        flag
        for flag, value in (
            ("--num-workers", num_workers if num_workers not in (None, 1) else None),
            ("--machine-rank", machine_rank or None),
            ("--machine-list", machine_list),
            ("--master-addr", master_addr if master_addr not in (None, "127.0.0.1", "localhost") else None),
        )
        if value is not None
    ]
    if given:
        raise LaunchError(
            f"--standalone runs on this machine alone, with a rendezvous on loopback; it cannot take "
            f"{', '.join(given)}. Drop --standalone to launch on several machines."
        )


def _check_module(name: str) -> None:
    """Refuse ``-m NAME`` when its top-level package cannot be found from the current folder or the installed
    packages (found without importing anything: the launcher never runs the user's code)."""
    import importlib.util

    sys.path.insert(0, os.getcwd())  # what python -m searches first
    try:
        found = importlib.util.find_spec(name.split(".")[0]) is not None
    except (ImportError, ValueError):
        found = False
    finally:
        sys.path.pop(0)
    if not found:
        raise LaunchError(
            f"-m {name}: no module {name!r} in the current folder ({os.getcwd()}) or the installed packages. Give "
            "the module's dotted name (package.module) from the folder that holds the package, or a script path "
            "without -m."
        )


def _check_address(address: str) -> None:
    """Refuse a ``--master-addr`` this machine cannot resolve, naming the flag."""
    import socket

    try:
        socket.getaddrinfo(address, None)
    except socket.gaierror as error:
        raise LaunchError(
            f"--master-addr {address!r}: cannot resolve this address ({error.strerror}). Give machine 0's address "
            "or host name (default 127.0.0.1, one machine)."
        ) from None
