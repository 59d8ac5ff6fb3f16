"""Timing EPL against PyTorch's own equivalent in the same run, and recording the result as typed rows.

The two are timed in alternating rounds so that both see the same machine load;
the reported ratio is the median of the per-round ratios (robust on noisy
machines). ``EPL_BENCH_SHORT=1`` (CI) runs few rounds: enough to keep the
benchmark working, not to measure.

Every benchmark records what it found with :func:`record`: rows of
:class:`ResultRow` (feature, what EPL is compared against, the ratios EPL / PyTorch
for time and memory, the run they come from) and the :class:`Section` that says
what they mean, as benchmarks/results/NAME.json in one schema (:data:`VERSION`).
``benchmarks/report.py`` only renders those files.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: Where :func:`record` writes (``EPL_BENCH_RESULTS`` names another folder, e.g. the GPU suite's).
RESULTS = Path(os.environ.get("EPL_BENCH_RESULTS") or Path(__file__).parent / "results")
#: The schema of the files :func:`record` writes; :func:`load` reads this one only.
VERSION = 1
MIB = 2**20
#: Read once at import: test fixtures clear EPL_* variables before each test.
_SHORT = os.environ.get("EPL_BENCH_SHORT", "") not in ("", "0")


def short_mode() -> bool:
    """Whether to run the quick CI version of every benchmark (``EPL_BENCH_SHORT=1``)."""
    return _SHORT


@dataclass(frozen=True)
class Ratio:
    """One ratio EPL / PyTorch; ``label`` says which when a row has several (e.g. "step peak")."""

    value: float
    label: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "value", float(self.value))
        if not isinstance(self.label, str):
            raise TypeError(f"a ratio's label must be a string, not {self.label!r}")

    def text(self) -> str:
        """``label value`` with two decimals (three under 0.1)."""
        number = f"{self.value:.3f}" if abs(self.value) < 0.1 else f"{self.value:.2f}"
        return f"{self.label} {number}" if self.label else number


@dataclass(frozen=True)
class Run:
    """When (UTC, ISO 8601), in which mode and on which machine a row was measured."""

    date: str
    short_mode: bool
    machine: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.date, str) or not isinstance(self.short_mode, bool):
            raise TypeError(f"a run needs an ISO date and a short_mode flag, not {self.date!r}, {self.short_mode!r}")
        if not isinstance(self.machine, dict):
            raise TypeError(f"a run's machine must be an object, not {self.machine!r}")

    @classmethod
    def now(cls) -> Run:
        """This run: now, :func:`short_mode`, :func:`machine_info`."""
        date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        return cls(date, short_mode(), machine_info())

    @property
    def mode(self) -> str:
        """``"short"`` (CI: keeps the benchmark working, does not measure) or ``"full"``."""
        return "short" if self.short_mode else "full"


@dataclass(frozen=True)
class ResultRow:
    """One comparison: a line of the report's summary table and the bars of its plots.

    ``plot`` is the bars' label (default: "feature vs against" without Markdown);
    ``run`` is stamped by :func:`record`.
    """

    feature: str
    against: str
    time: tuple[Ratio, ...] = ()
    memory: tuple[Ratio, ...] = ()
    plot: str = ""
    run: Run | None = None

    def __post_init__(self) -> None:
        for name in ("feature", "against", "plot"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"a row's {name} must be a string, not {getattr(self, name)!r}")
        for name in ("time", "memory"):
            ratios = tuple(getattr(self, name))
            if not all(isinstance(ratio, Ratio) for ratio in ratios):
                raise TypeError(f"a row's {name} must be Ratio objects, not {ratios!r}")
            object.__setattr__(self, name, ratios)

    def label(self) -> str:
        """The bars' label, without Markdown."""
        return (self.plot or f"{self.feature} vs {self.against}").replace("`", "")


@dataclass(frozen=True)
class Section:
    """What a benchmark measures and what its ratios mean (Markdown), shown with its rows' details."""

    title: str
    test: str
    text: str

    def __post_init__(self) -> None:
        path = Path(self.test)
        if path.is_absolute() and path.resolve().is_relative_to(ROOT):
            object.__setattr__(self, "test", path.resolve().relative_to(ROOT).as_posix())


@dataclass(frozen=True, kw_only=True)
class Result:
    """What one file of benchmarks/results/ holds: a benchmark's rows, its section, the figures behind them."""

    version: int = VERSION
    name: str
    section: Section
    rows: tuple[ResultRow, ...]
    details: tuple[str, ...] = ()

    def to_json(self) -> str:
        """The file's text."""
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Result:
        """The result ``to_json`` wrote as ``data``; KeyError, TypeError or ValueError when it is not one."""

        def row(entry: dict[str, Any]) -> ResultRow:
            ratios = {kind: tuple(Ratio(**ratio) for ratio in entry.get(kind, ())) for kind in ("time", "memory")}
            run = Run(**entry["run"]) if entry.get("run") is not None else None
            return ResultRow(entry["feature"], entry["against"], **ratios, plot=entry.get("plot", ""), run=run)

        details = data.get("details", ())
        if isinstance(details, str) or not all(isinstance(line, str) for line in details):
            raise TypeError("details must be a list of strings")
        rows = tuple(map(row, data["rows"]))
        return cls(name=str(data["name"]), section=Section(**data["section"]), rows=rows, details=tuple(details))


class NotAResult(ValueError):
    """A file that is JSON but not a result :func:`record` wrote (another schema, or wrong content)."""


def record(name: str, rows: Sequence[ResultRow], *, section: Section, details: Sequence[str] = ()) -> Path:
    """Write benchmarks/results/NAME.json: ``rows`` stamped with this run, ``section`` and ``details``.

    ``details`` are the lines of figures behind the ratios that the report shows under
    ``section`` (times, bytes, sizes); the report reads nothing else from the file.
    """
    run = Run.now()
    result = Result(
        name=name, section=section, rows=tuple(replace(row, run=run) for row in rows), details=tuple(details)
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(result.to_json())
    return path


def load(path: Path) -> Result:
    """Read a file :func:`record` wrote: OSError or ValueError if unreadable, :class:`NotAResult` if not one."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or data.get("version") != VERSION:
        found = data.get("version") if isinstance(data, dict) else type(data).__name__
        raise NotAResult(f"not a result file of version {VERSION} (found {found}); run its benchmark again")
    try:
        return Result.from_dict(data)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise NotAResult(f"unexpected content ({type(exc).__name__}: {exc})") from exc


def ms(value: float) -> str:
    """Milliseconds for a detail line: two decimals under 10 ms, one above."""
    return f"{value:.2f} ms" if value < 10 else f"{value:.1f} ms"


def mib(value: float) -> str:
    """Bytes as MiB for a detail line."""
    return f"{value / MIB:.2f} MiB"


@dataclass(frozen=True)
class Comparison:
    """Median seconds per call of the baseline (PyTorch) and of EPL, and EPL / PyTorch."""

    name: str
    baseline_s: float
    epl_s: float
    ratio: float
    rounds: int
    calls_per_round: int

    def line(self) -> str:
        """One human line for logs and READMEs."""
        return (
            f"{self.name}: PyTorch {self.baseline_s * 1e3:.3f} ms, EPL {self.epl_s * 1e3:.3f} ms, "
            f"ratio {self.ratio:.3f} ({self.rounds} rounds x {self.calls_per_round} calls)"
        )

    def detail(self) -> str:
        """The figures behind the ratio, for a report section."""
        return (
            f"PyTorch {ms(self.baseline_s * 1e3)}, EPL {ms(self.epl_s * 1e3)}, ratio {self.ratio:.3f} "
            f"(median of {self.rounds} rounds x {self.calls_per_round} calls)"
        )

    def row(self, template: ResultRow) -> ResultRow:
        """``template`` (feature, against, memory, plot) with this comparison's time ratio."""
        return replace(template, time=(Ratio(self.ratio),))


def median_step_seconds(
    step: Callable[[], object], steps: int, warmup: int = 2, sync: Callable[[], object] | None = None
) -> float:
    """The median seconds of ``steps`` calls of ``step`` after ``warmup`` untimed ones; in a job, the ranks start
    each call together (a barrier). ``sync`` ends each call (a device's synchronize, so the clock covers its
    work)."""
    import torch.distributed as dist

    def call() -> None:
        step()
        if sync is not None:
            sync()

    for _ in range(warmup):
        call()
    times = []
    for _ in range(steps):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def race_steps(
    name: str,
    baseline_step: Callable[[], object],
    epl_step: Callable[[], object],
    *,
    rounds: int,
    steps: int,
    warmup: int = 1,
) -> dict[str, Any]:
    """On every rank of a job: ``steps`` training steps of each side per round, in alternating rounds with a barrier
    before each run (:func:`compare`, nothing saved); the ratio and each side's time per step."""
    import torch.distributed as dist

    def runs(step: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(steps):
                step()

        return run

    result = compare(
        name,
        runs(baseline_step),
        runs(epl_step),
        rounds=rounds,
        calls_per_round=1,
        warmup=warmup,
        sync=dist.barrier,
        save=False,
    )
    return {
        "ratio": result.ratio,
        "torch_ms": result.baseline_s * 1e3 / steps,
        "epl_ms": result.epl_s * 1e3 / steps,
        "rounds": rounds,
        "steps": steps,
    }


def record_step_race(
    name: str,
    result: Mapping[str, Any],
    *,
    feature: str,
    against: str,
    plot: str,
    section: Section,
    detail: str,
    max_ratio: float,
    printed: str | None = None,
) -> None:
    """The tail every step-time race shares: ``result`` (what :func:`race_steps` returns, or any dict with
    ``ratio``) recorded as one time row in benchmarks/results/NAME.json with ``detail`` under ``section``,
    ``printed`` (default ``detail``) shown, and EPL no more than ``max_ratio`` times PyTorch's time."""
    row = ResultRow(feature, against, time=(Ratio(result["ratio"]),), plot=plot)
    record(name, [row], section=section, details=[detail])
    print(f"\n{printed if printed is not None else detail}")
    assert result["ratio"] < max_ratio, result


def step_times(result: Mapping[str, Any]) -> str:
    """``PyTorch 1.23 ms, EPL 1.20 ms per step, ratio 0.976 (15 rounds x 3 steps)`` from :func:`race_steps`."""
    return (
        f"PyTorch {ms(result['torch_ms'])}, EPL {ms(result['epl_ms'])} per step, ratio {result['ratio']:.3f} "
        f"({result['rounds']} rounds x {result['steps']} steps)"
    )


def compare(
    name: str,
    baseline: Callable[[], object],
    candidate: Callable[[], object],
    *,
    rounds: int,
    calls_per_round: int,
    warmup: int = 5,
    sync: Callable[[], object] | None = None,
    save: bool = True,
    row: ResultRow | None = None,
    section: Section | None = None,
) -> Comparison:
    """Time ``baseline`` and ``candidate`` in alternating rounds; print, record and return the comparison.

    ``sync`` (e.g. a barrier) runs before each timed run, so that several processes
    time the same thing at the same time; ``save=False`` on all but one of them (it
    prints the comparison's line). Given ``row`` and ``section``, the saving process also
    records NAME.json (:func:`record`): ``row`` with the time ratio, and the comparison's figures.
    """
    for _ in range(warmup):
        baseline()
        candidate()
    base_times, epl_times, ratios = [], [], []
    for index in range(rounds):
        order = (baseline, candidate) if index % 2 == 0 else (candidate, baseline)
        measured = {}
        for fn in order:
            if sync is not None:
                sync()
            start = time.perf_counter()
            for _ in range(calls_per_round):
                fn()
            measured[fn] = (time.perf_counter() - start) / calls_per_round
        base_times.append(measured[baseline])
        epl_times.append(measured[candidate])
        ratios.append(measured[candidate] / measured[baseline])
    result = Comparison(
        name=name,
        baseline_s=statistics.median(base_times),
        epl_s=statistics.median(epl_times),
        ratio=statistics.median(ratios),
        rounds=rounds,
        calls_per_round=calls_per_round,
    )
    if save:
        if row is not None and section is not None:
            record(name, [result.row(row)], section=section, details=[result.detail()])
        print(result.line())
    return result


def machine_info() -> dict[str, Any]:
    """CPU model, cores, memory, OS, Python and torch versions, and the load average when the result was saved."""
    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": _memory_gib(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        info["torch"] = None
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None
