"""Run every feature a subset of EPL's packages offers, in a virtual environment holding only that subset.

    python tests/subsets/check_subset.py epl-core epl-memory     # nox -s "subsets(subset='memory')" runs it

Run by ``nox -t ci`` (the ``subsets(all)`` session: one environment, each subset's packages installed alone in
turn, as a user would, not editable, with nothing else: no test tools, no numpy by hand). Each check
trains a small model, saves a checkpoint, loads it into a fresh engine and compares, on one or
two processes under the launchers the subset has; the packages outside the subset must be missing
and a feature that needs one must say which to install. The checks run two at a time (each is a fresh process
that spends most of its time importing torch); it prints one line per check, in order, and exits non-zero at the
first that fails. Not a pytest module: it must run without pytest installed.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

#: The module each package installs.
MODULES = {
    "epl-core": "epl",
    "epl-comm": "epl_comm",
    "epl-launch": "epl_launch",
    "epl-memory": "epl_memory",
    "epl-pipeline": "epl_pipeline",
}
#: Seconds any one command may take.
TIMEOUT = 300
#: Checks running at once (the machines CI runs on have 2 cores).
AT_ONCE = 2
_POOL = ThreadPoolExecutor(AT_ONCE)
#: The checks started, in order, each as the call that waits for it and judges it.
_STARTED: list[Callable[[], None]] = []

#: Trains 3 steps, saves, loads into a fresh engine; every rank checks its tensors came back equal.
TRAIN_SAVE_LOAD = textwrap.dedent(
    """
    import ast
    import sys
    import torch
    from torch import nn
    import epl

    config, pipeline, folder = ast.literal_eval(sys.argv[1]), sys.argv[2] == "pipeline", sys.argv[3]

    def build():
        torch.manual_seed(0)
        if not pipeline:
            return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        with epl.replicate(device_count=1, name="stage_0"):
            first = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        with epl.replicate(device_count=1, name="stage_1"):
            second = nn.Linear(16, 1)
        return nn.Sequential(first, second)

    def engine():
        epl.init(epl.Config(config))  # a fresh start for each engine's annotations
        return epl.parallelize(build(), optimizer=lambda p: torch.optim.Adam(p, lr=0.01), loss_fn=nn.MSELoss())

    trained = engine()
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        loss = trained.step(torch.randn(8, 8, generator=generator), torch.randn(8, 1, generator=generator))
    trained.save(folder)
    loaded = engine()
    loaded.load(folder)
    for (name, a), b in zip(trained.model.state_dict().items(), loaded.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert loaded.global_step == 3
    rank = epl.Env.get().cluster.rank
    print(f"rank {rank}: {loaded.plan.num_replicas} replica(s), {loaded.plan.num_stages} stage(s), {float(loss):.4f}")
    """
)


def main() -> int:
    packages = sys.argv[1:]
    check_installed(packages)
    folder = Path(tempfile.mkdtemp(prefix="epl-subset-"))
    script = folder / "train.py"
    script.write_text(TRAIN_SAVE_LOAD)
    epl = str(Path(sys.executable).parent / "epl")
    python = [sys.executable]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]

    def train(launcher: list[str], name: str, kind: str = "plain", config: dict | None = None) -> list[str]:
        return [*launcher, str(script), repr(config or {}), kind, str(folder / name)]

    run("one process: train, save, load", train(python, "one"))
    run("epl plan for 8 devices", [epl, "plan", "--world-size", "8", str(script), "{}", "plain", "-"])
    if "epl-comm" in packages:
        run("data parallel on 2 processes (torchrun): train, save, load", train(torchrun, "dp"))
    else:
        fails("2 processes without epl-comm", train(torchrun, "dp"), "pip install epl-comm")
    if "epl-launch" in packages:
        run("epl launch on 2 processes: train, save, load", train([epl, "launch", "--nproc-per-node", "2"], "launch"))
    else:
        fails("epl launch without epl-launch", [epl, "launch", str(script)], "epl-launch")
    if "epl-pipeline" in packages:
        run("2-stage pipeline (torchrun): train, save, load", train(torchrun, "pp", "pipeline"))
        schedule = [epl, "schedule", "--stages", "2", "--micro-batches", "4"]
        run("epl schedule (text)", schedule)
        if importlib.util.find_spec("matplotlib") is None:
            picture = [*schedule, "--png", str(folder / "s.png")]
            fails("a timeline picture without matplotlib", picture, "pip install 'epl-pipeline[plot]'")
    elif "epl-comm" in packages:
        fails("a pipeline without epl-pipeline", train(torchrun, "pp", "pipeline"), "pip install epl-pipeline")
    if "epl-memory" in packages:
        memory = {"gradient_checkpoint.type": "auto", "amp.level": "O1"}
        run("checkpointing + AMP in one process: train, save, load", train(python, "memory", config=memory))
    else:
        fails("AMP without epl-memory", train(python, "amp", config={"amp.level": "O1"}), "epl-memory")
    for judge in _STARTED:
        judge()
    return 0


def check_installed(packages: list[str]) -> None:
    """The subset's modules import; every other EPL package is missing (so the checks test the subset alone)."""
    for distribution, module in MODULES.items():
        present = importlib.util.find_spec(module) is not None
        if present != (distribution in packages):
            raise SystemExit(f"{distribution} is {'installed' if present else 'missing'}; the subset is {packages}")
    print(f"installed: {', '.join(packages)}; missing: {', '.join(sorted(set(MODULES) - set(packages))) or 'none'}")


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, env=env)


def run(what: str, command: list[str]) -> None:
    """Start one check; it must succeed (judged in order at the end of ``main``)."""
    started: Future[subprocess.CompletedProcess[str]] = _POOL.submit(_run, command)

    def judge() -> None:
        done = started.result()
        if done.returncode != 0:
            raise SystemExit(f"FAILED {what}: {' '.join(command)}\n{done.stdout}\n{done.stderr}")
        print(f"ok   {what}", flush=True)

    _STARTED.append(judge)


def fails(what: str, command: list[str], names: str) -> None:
    """Start one check; it must fail with an error that names ``names`` (what to install)."""
    started: Future[subprocess.CompletedProcess[str]] = _POOL.submit(_run, command)

    def judge() -> None:
        done = started.result()
        if done.returncode == 0 or names not in done.stdout + done.stderr:
            raise SystemExit(f"FAILED {what}: expected a failure naming {names!r}:\n{done.stdout}\n{done.stderr}")
        print(f"ok   {what}: the error names {names}", flush=True)

    _STARTED.append(judge)


if __name__ == "__main__":
    sys.exit(main())
