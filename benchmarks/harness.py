"""Timing EPL against PyTorch's own equivalent in the same run, as a ratio.

The two are timed in alternating rounds so that both see the same machine load;
the reported ratio is the median of the per-round ratios (robust on noisy
machines). ``EPL_BENCH_SHORT=1`` (CI) runs few rounds: enough to keep the
benchmark working, not to measure.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
#: Read once at import: test fixtures clear EPL_* variables before each test.
_SHORT = os.environ.get("EPL_BENCH_SHORT", "") not in ("", "0")


def short_mode() -> bool:
    """Whether to run the quick CI version of every benchmark (``EPL_BENCH_SHORT=1``)."""
    return _SHORT


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
) -> Comparison:
    """Time ``baseline`` and ``candidate`` in alternating rounds; save and return the comparison.

    ``sync`` (e.g. a barrier) runs before each timed run, so that several processes
    time the same thing at the same time; ``save=False`` on all but one of them.
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
        save_result(name, asdict(result))
        print(result.line())
    return result


def save_result(name: str, data: dict[str, object]) -> None:
    """Write ``data`` to benchmarks/results/NAME.json, with the run's date, mode and machine under ``"run"``."""
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps({**data, "run": run_info()}, indent=2))


def run_info() -> dict[str, object]:
    """When (UTC), in which mode and on which machine a result was measured (read by benchmarks/report.py)."""
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "short_mode": short_mode(),
        "machine": machine_info(),
    }


def machine_info() -> dict[str, object]:
    """CPU model, cores, memory, OS, Python and torch versions, and the load average when the result was saved."""
    info: dict[str, object] = {
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
