"""Sessions for development and CI: tests, lint, bench, demo, zoo.

``nox -t ci`` is what CI runs (.ci/run): lint, the type check (mypy), the tests and then the benchmarks in short
mode (one environment), every subset of the packages installed alone, and the docs site. Each session installs
the packages of packages/ in editable mode (``subsets``: as a user would, only some) with
the pins of constraints.txt (torch==2.13.0, the CPU build).
"""

from __future__ import annotations

from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = sorted(str(p.parent) for p in (ROOT / "packages").glob("*/pyproject.toml"))
CONSTRAINTS = ("-c", str(ROOT / "constraints.txt"))
#: The example plugin of docs/plugins.md, installed (editable) for tests/examples/test_plugin_package.py.
EXAMPLE_PLUGINS = ("-e", str(ROOT / "examples" / "plugin"))
#: tensorboard: epl.Progress's optional scalars (tests/core/test_progress.py); accelerate and deepspeed: the
#: originals of the migration guides (tests/examples/test_migration.py); peft, tokenizers and datasets: fine-tuning
#: with adapters and examples/finetune (docs/finetuning.md); torchao: float8 training (docs/float8.md).
TEST_TOOLS = (
    "pytest", "pytest-timeout", "pytest-benchmark", "numpy", "mpi4py", "mpich", "transformers", "tensorboard",
    "accelerate", "deepspeed", "peft", "tokenizers", "datasets", "torchao",
)  # fmt: skip
#: benchmarks/report.py draws its plots with matplotlib (also epl-pipeline's ``plot`` extra, for timeline pictures).
BENCH_TOOLS = ("matplotlib",)
#: The documentation site's tools; ruff lays out the long signatures in the API reference.
DOCS_TOOLS = ("mkdocs", "mkdocstrings[python]", "ruff", "pytest", "pytest-timeout")
#: Subsets of the packages a user may install alone (tests/subsets/check_subset.py runs each one's features).
SUBSETS = {
    "core": ("epl-core",),
    "memory": ("epl-core", "epl-memory"),
    "pipeline": ("epl-core", "epl-comm", "epl-pipeline"),
    "launch": ("epl-core", "epl-comm", "epl-launch"),
}
SINGLE_THREAD = {"OMP_NUM_THREADS": "1"}

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True


def install_packages(session: nox.Session, *extra: str) -> None:
    """Install every package of packages/ (editable) and ``extra``, with the pins."""
    editable = [arg for package in PACKAGES for arg in ("-e", package)]
    session.install(*CONSTRAINTS, *editable, *extra)


@nox.session(tags=["ci"])
def lint(session: nox.Session) -> None:
    """Ruff over the whole repository."""
    session.install(*CONSTRAINTS, "ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(tags=["ci"])
def typecheck(session: nox.Session) -> None:
    """mypy over the packages and the example plugin, as [tool.mypy] in pyproject.toml sets it: strict on the public
    API (``epl``, ``epl.plugin_api`` and the modules they export from), the default level elsewhere. The packages
    are installed (with torch, whose annotations the check reads) but none of the test tools; mypy reads the sources
    of packages/ itself."""
    install_packages(session, "mypy")
    session.run("mypy", *session.posargs)


@nox.session(tags=["ci"])
def tests(session: nox.Session) -> None:
    """The test suite (multi-process tests included; extra arguments go to its pytest), then the benchmarks in
    short mode and their report, as ``bench-short`` runs them: in this one environment, which has everything
    they need, CI saves a second install of the same packages (about 2 minutes)."""
    install_packages(session, *TEST_TOOLS, *BENCH_TOOLS, *EXAMPLE_PLUGINS)
    # the 20 slowest tests, printed at the end: where CI's minutes go (CI must finish within 30 minutes)
    session.run("pytest", "tests", "--durations=20", *session.posargs, env=SINGLE_THREAD)
    _short_benchmarks(session)


@nox.session
@nox.parametrize("subset", [nox.param(None, id="all", tags=["ci"]), *SUBSETS])
def subsets(session: nox.Session, subset: str | None) -> None:
    """Subsets of the packages, installed as a user would (not editable, nothing else): each trains, saves and loads
    on the launchers it has, and the missing packages' features name what to install. Without ``subset`` (CI) every
    subset in turn, in one environment: its packages installed, checked, uninstalled (torch is installed once; the
    subsets come in an order where none adds a dependency another lacks)."""
    names = [subset] if subset else list(SUBSETS)
    installed = sorted({package for packages in SUBSETS.values() for package in packages})
    for name in names:
        session.run("pip", "uninstall", "--yes", "--quiet", *installed, silent=True)
        session.install(*CONSTRAINTS, *(str(ROOT / "packages" / package) for package in SUBSETS[name]))
        session.run("python", "tests/subsets/check_subset.py", *SUBSETS[name], env=SINGLE_THREAD)


@nox.session(tags=["ci"])
def docs(session: nox.Session) -> None:
    """The documentation site (mkdocs.yml), built with --strict into the session's temporary folder: a broken
    link, a page left out of the nav or a docstring that griffe cannot read fails it. Then tests/docs checks that
    the API reference names every public name, and what the built pages hold."""
    install_packages(session, *DOCS_TOOLS)
    site = Path(session.create_tmp()) / "site"
    session.run("mkdocs", "build", "--strict", "--site-dir", str(site))
    session.run("pytest", "tests/docs", *session.posargs, env=SINGLE_THREAD)


@nox.session
def bench(session: nox.Session) -> None:
    """Every benchmark, EPL against PyTorch's own equivalent (results in benchmarks/results/), then the
    report docs/benchmarks.md and its plots docs/benchmarks/*.svg; the report is written even when a
    benchmark fails (from the results there are), and the session still fails."""
    install_packages(session, *TEST_TOOLS, *BENCH_TOOLS)
    try:
        session.run("pytest", "benchmarks", "-s", *session.posargs, env=SINGLE_THREAD)
    finally:
        session.run("python", "-m", "benchmarks.report")


@nox.session(name="bench-short")
def bench_short(session: nox.Session) -> None:
    """The benchmarks in short mode, so that they never rot, then their report, rendered into the session's
    temporary folder (docs/benchmarks.md keeps the figures of a full run). CI runs them in ``tests``."""
    install_packages(session, *TEST_TOOLS, *BENCH_TOOLS)
    _short_benchmarks(session, *session.posargs)


def _short_benchmarks(session: nox.Session, *args: str) -> None:
    """``pytest benchmarks`` in short mode, then the report into the session's temporary folder."""
    session.run("pytest", "benchmarks", "-s", *args, env={**SINGLE_THREAD, "EPL_BENCH_SHORT": "1"})
    session.run("python", "-m", "benchmarks.report", "--out", str(Path(session.create_tmp()) / "benchmarks.md"))


@nox.session(name="bench-accelerate")
def bench_accelerate(session: nox.Session) -> None:
    """EPL's Ulysses context parallelism against Accelerate's Ulysses (DeepSpeed's UlyssesSPAttentionHF) on 2
    processes, on the CPU (DeepSpeed's CPU accelerator, gloo), after checking both take the same step; the result in
    benchmarks/results/context_ulysses_accelerate.json, then the report rendered into the session's temporary folder
    (docs/benchmarks.md is written by ``nox -s bench``, which runs this benchmark too, from every benchmark's
    results). ``EPL_BENCH_SHORT=1`` for short mode."""
    # TEST_TOOLS has accelerate and deepspeed (pinned in constraints.txt; deepspeed builds as pure Python, no CUDA).
    install_packages(session, *TEST_TOOLS, *BENCH_TOOLS)
    env = {**SINGLE_THREAD, "DS_ACCELERATOR": "cpu"}
    try:
        session.run("pytest", "benchmarks/test_context_accelerate.py", "-s", *session.posargs, env=env)
    finally:
        session.run("python", "-m", "benchmarks.report", "--out", str(Path(session.create_tmp()) / "benchmarks.md"))


@nox.session
def bigmem(session: nox.Session) -> None:
    """The big-memory run alone: a 1.5B-parameter Llama (5.6 GiB in float32) built on meta under split(2) x 2
    stages on 4 processes, one step, each rank's peak memory at most 0.6x the model (about 10 minutes on 2
    cores; benchmarks/results/big_memory.json). CI runs it on a 0.10B model, in bench-short."""
    install_packages(session, *TEST_TOOLS, *BENCH_TOOLS)
    session.run("pytest", "benchmarks/test_big_memory.py", "-s", *session.posargs, env=SINGLE_THREAD)


@nox.session(name="zero-memory")
def zero_memory(session: nox.Session) -> None:
    """ZeRO's peak memory per rank against FSDP2 alone: a 380M Llama built on meta at 2 and 4 ranks, a 191M one at
    2, 4 and 8 (about 40 minutes on 2 cores; benchmarks/results/zero_memory.json and
    docs/images/zero_memory_per_rank.svg). CI runs a 2-layer Llama on 2 ranks, in bench-short."""
    install_packages(session, *TEST_TOOLS, *BENCH_TOOLS)
    session.run("pytest", "benchmarks/test_zero_memory.py", "-s", *session.posargs, env=SINGLE_THREAD)


@nox.session(name="planner-memory")
def planner_memory(session: nox.Session) -> None:
    """The planner's predicted peak memory per rank against the measured one, for every layout the zoo runs (data
    parallel, ZeRO v0-v2, split with and without sequence parallelism, 2 stages under each schedule, 3D, context) on
    a 123M Llama, 2 to 8 processes (about 7 minutes on 2 cores; benchmarks/results/planner_memory.json, and the table
    of docs/planner.md printed). ``-- NAME ...`` measures some layouts; ``-- --again FILE`` predicts a measured
    file's ranks anew. CI runs a slice on a 31M Llama (tests/planner/test_measured_memory.py). Without arguments,
    then torchtitan's 3D recipe (torch's FSDP2, tensor parallelism and pipelining) against the planner: 4 and 8
    processes, about 4 minutes (benchmarks/recipe_memory.py; CI's slice: tests/planner/test_recipe_memory.py)."""
    install_packages(session, *TEST_TOOLS)
    session.run("python", "-m", "benchmarks.planner_memory", *session.posargs, env=SINGLE_THREAD)
    if not session.posargs:
        session.run("python", "-m", "benchmarks.recipe_memory", env=SINGLE_THREAD)


@nox.session(name="compile")
def compile_suite(session: nox.Session) -> None:
    """``compile.enabled`` under every layout with inductor (CI runs a slice with aot_eager), and its benchmark."""
    install_packages(session, *TEST_TOOLS, *BENCH_TOOLS)
    env = {**SINGLE_THREAD, "EPL_COMPILE_BACKEND": "inductor"}
    session.run("pytest", "tests/compiling", *session.posargs, env=env)
    session.run("pytest", "benchmarks/test_compile.py", "benchmarks/test_compile_split.py", "-s", env=SINGLE_THREAD)


@nox.session
def zoo(session: nox.Session) -> None:
    """The model-zoo conformance run: every architecture of tests/zoo/architectures.py's full matrix under every
    layout (data parallel, split, pipeline, 3D, ZeRO v1, clipping) and every other causal-LM and seq2seq
    architecture under split(2), each against one process; writes docs/models.md (about 1-2 hours on 2 cores).
    CI runs a slice of it (tests/zoo/test_zoo.py)."""
    install_packages(session, *TEST_TOOLS)
    # A part of the matrix (``nox -s zoo -- --only llama --layouts "split(2)"``) is printed, not written.
    out = [] if session.posargs else ["--out", str(ROOT / "docs" / "models.md")]
    session.run("python", "-m", "tests.zoo.conformance", *out, *session.posargs, env=SINGLE_THREAD)


@nox.session
def demo(session: nox.Session) -> None:
    """The demo job: the quick start data parallel and the two-stage pipeline on 2 processes
    (epl launch), the other examples (ResNet data parallel with checkpointing and ZeRO, BERT
    pipeline, MoE expert parallel, the by-hand model) on 2 processes, then the pipeline planned
    for 8 devices and the MoE example for 1024."""
    install_packages(session, "numpy")
    session.run("epl", "launch", "--nproc-per-node", "2", "examples/quickstart/train.py", env=SINGLE_THREAD)
    session.run("epl", "launch", "--nproc-per-node", "2", "examples/pipeline/train.py", env=SINGLE_THREAD)
    for example, flags in [
        ("resnet_dp", ["--checkpointing", "--zero", "v1"]),
        ("bert_pipeline", []),
        ("moe_transformer", []),
        ("model_parallel_by_hand", []),
    ]:
        script = f"examples/{example}/train.py"
        session.run("epl", "launch", "--nproc-per-node", "2", script, *flags, env=SINGLE_THREAD)
    session.run("epl", "plan", "--world-size", "8", "--gpu-per-worker", "4", "examples/pipeline/train.py")
    session.run("epl", "plan", "--world-size", "1024", "--gpu-per-worker", "8", "--example", "moe")
