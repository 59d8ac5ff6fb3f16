"""The benchmark report: the rows every benchmark recorded in benchmarks/results/, as one Markdown page with plots.

    python -m benchmarks.report [--results benchmarks/results] [--out docs/benchmarks.md] [--plots DIR] [--note TEXT]

Each benchmark records typed rows (:func:`benchmarks.harness.record`): the feature, what
EPL is compared against, its time and memory ratios EPL / PyTorch, the run (date, mode,
machine), and the section that says what they mean with the figures behind them. This
module only renders them: a summary table, a section per benchmark, the machines, and
two plots drawn with matplotlib (horizontal bars of every ratio on a log scale, a line
at 1.0). A file it cannot read gets a line saying so.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator

from benchmarks.harness import ROOT, NotAResult, Ratio, Result, ResultRow, Run, Section, load

DEFAULT_RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_OUT = ROOT / "docs" / "benchmarks.md"
INTRO = (
    "Every benchmark runs EPL and PyTorch's own equivalent in the same job, on the same model and data, timed in "
    "alternating rounds, and reports **EPL / PyTorch**: below 1.0 EPL is faster or holds less memory, above 1.0 it "
    "is slower or holds more. A ratio is the median of the per-round ratios, so the two sides see the same machine "
    "load; absolute times on a shared machine are not comparable between runs. *Mode* `short` is the CI mode (few "
    "rounds, smaller inputs): it keeps the benchmarks working but does not measure."
)


@dataclass
class Report:
    """The results of one folder in page order (by benchmark), and a line per file that could not be read."""

    results: list[tuple[str, Result]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    files: int = 0

    @property
    def rows(self) -> list[ResultRow]:
        """Every row, section by section."""
        return [row for _, result in self.results for row in result.rows]

    def sections(self) -> dict[Section, tuple[list[str], list[str]]]:
        """Each section with the detail lines and the file names of its results."""
        sections: dict[Section, tuple[list[str], list[str]]] = {}
        for name, result in self.results:
            details, sources = sections.setdefault(result.section, ([], []))
            details.extend(result.details)
            sources.append(name)
        return sections


def collect(results: Path) -> Report:
    """Read every ``*.json`` of ``results``; what cannot be read becomes a line in ``problems``."""
    report = Report()
    paths = sorted(results.glob("*.json")) if results.is_dir() else []
    report.files = len(paths)
    for path in paths:
        try:
            report.results.append((path.name, load(path)))
        except NotAResult as exc:
            report.problems.append(f"`{path.name}`: {exc}; skipped.")
        except (OSError, ValueError) as exc:
            report.problems.append(f"`{path.name}`: not readable as JSON ({type(exc).__name__}: {exc}); skipped.")
    report.results.sort(key=lambda item: (item[1].section.test, item[1].section.title, item[0]))
    return report


def date_label(run: Run | None) -> str:
    """The run's date as ``YYYY-MM-DD HH:MM`` (UTC)."""
    if run is None:
        return "?"
    try:
        parsed = datetime.datetime.fromisoformat(run.date)
    except ValueError:
        return run.date
    return (parsed.astimezone(datetime.UTC) if parsed.tzinfo else parsed).strftime("%Y-%m-%d %H:%M")


def machine_label(run: Run | None) -> str:
    """A short name of the machine: CPU model, cores, GPU if any, torch version."""
    machine = run.machine if run else {}
    if not machine:
        return "?"
    parts = [str(machine.get("cpu") or "unknown CPU") + (f", {machine['cores']} cores" if machine.get("cores") else "")]
    parts += [str(machine["gpu"])] if machine.get("gpu") else []
    return ", ".join(parts + ([f"torch {machine['torch']}"] if machine.get("torch") else []))


def table(rows: Sequence[ResultRow]) -> list[str]:
    """The summary table, one line per row."""
    lines = [
        "| Feature | EPL against | Time, EPL / PyTorch | Memory, EPL / PyTorch | Mode | Date (UTC) | Machine |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        time, memory = (", ".join(r.text() for r in ratios) or "—" for ratios in (row.time, row.memory))
        cells = [row.feature, row.against, time, memory, row.run.mode if row.run else "?", date_label(row.run)]
        cells.append(machine_label(row.run))
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return lines


def machines(report: Report) -> list[str]:
    """One line per machine the results come from, with the load averages seen when they were recorded."""
    runs: dict[str, list[Run]] = {}
    for _, result in report.results:
        if result.rows and (run := result.rows[0].run) is not None:
            runs.setdefault(machine_label(run), []).append(run)
    lines = []
    for label, seen in runs.items():
        m, dates = seen[0].machine, sorted(date_label(run) for run in seen)
        gpu = f"GPU {m['gpu']}" if m.get("gpu") else "no GPU"
        line = (
            f"- **{label}**: CPU {m.get('cpu', '?')}; {m.get('cores', '?')} logical cores "
            f"({m.get('usable_cores', '?')} usable); {m.get('memory_gib', '?')} GiB memory; {gpu}; "
            f"{m.get('platform', '?')}; Python {m.get('python', '?')}; torch {m.get('torch', '?')}; "
            f"OMP_NUM_THREADS={m.get('omp_num_threads')}. {len(seen)} result file(s), "
            f"recorded {dates[0]} to {dates[-1]} UTC"
        )
        loads = [load[0] for run in seen if isinstance(load := run.machine.get("load_average"), list) and load]
        if loads:
            line += f"; 1-minute load average {min(loads):.1f}–{max(loads):.1f} (median {statistics.median(loads):.1f})"
            cores = m.get("usable_cores") or m.get("cores")
            if isinstance(cores, int) and max(loads) > cores:
                line += ": above the core count, the machine was busy with other work; only ratios compare"
        lines.append(line + ".")
    return lines


def bars(rows: Sequence[ResultRow], kind: str) -> list[tuple[str, float]]:
    """One bar per ``kind`` ("time" or "memory") ratio: the row's label, the ratio's label, short runs marked."""
    out = []
    for row in rows:
        short = " (short run)" if row.run and row.run.short_mode else ""
        out += [(row.label() + (f": {r.label}" if r.label else "") + short, r.value) for r in getattr(row, kind)]
    return out


def plot(title: str, data: Sequence[tuple[str, float]], path: Path) -> None:
    """Horizontal bars from 1.0 to each ratio on a log-2 scale, a line at 1.0, written as SVG to ``path``.

    Drawn on an Agg canvas without pyplot (no display, no global figure state); the SVG keeps its text as text
    and carries no date, so an unchanged result gives an unchanged file.
    """
    data = [(label, value) for label, value in data if math.isfinite(value) and value > 0]
    values = [value for _, value in data] or [1.0]
    low = 2.0 ** min(-1, math.floor(math.log2(min(values) / 1.5)))
    high = 2.0 ** max(1, math.ceil(math.log2(max(values) * 1.5)))
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "epl-benchmarks", "font.size": 10}):
        figure = Figure(figsize=(9, 1.6 + 0.32 * max(len(data), 1)))
        FigureCanvasAgg(figure)
        axes = figure.subplots()
        axes.set_xscale("log", base=2)
        axes.set_xlim(low, high)
        axes.xaxis.set_major_locator(LogLocator(base=2))
        axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        axes.grid(axis="x", color="#dddddd")
        axes.set_axisbelow(True)
        for index, (_, value) in enumerate(data):
            colour = "#2a9d8f" if value <= 1.0 else "#e76f51"  # EPL faster or smaller; slower or larger
            axes.barh(index, value - 1.0, left=1.0, height=0.7, color=colour, gid=f"bar-{index}")
            outside = value * 1.05 if value > 1.0 else value / 1.05
            axes.text(outside, index, Ratio(value).text(), va="center", ha="left" if value > 1.0 else "right")
        axes.axvline(1.0, color="black", linewidth=1.2, gid="line-1.0")
        axes.set_yticks(range(len(data)), [label for label, _ in data])
        axes.set_ylim(max(len(data), 1) - 0.5, -0.5)
        axes.set_xlabel("EPL / PyTorch, log scale: left of 1.0 EPL is faster or smaller, right of it slower or larger")
        axes.set_title(title, fontweight="bold")
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, format="svg", bbox_inches="tight", metadata={"Date": None})


def markdown(report: Report, plots: dict[str, Path], out: Path, results: Path, notes: Sequence[str] = ()) -> str:
    """The whole page."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M")
    shown = results.resolve().relative_to(ROOT) if results.resolve().is_relative_to(ROOT) else results
    lines = [
        "# Benchmarks: EPL against PyTorch",
        "",
        f"Generated by `python -m benchmarks.report` on {now} UTC from {report.files} file(s) in `{shown}/`. "
        "`nox -s bench` runs every benchmark (`pytest benchmarks`) and then writes this page; "
        "`nox -s bench-short` runs them in short mode (CI does so in its `tests` session), which keeps them "
        "working but does not measure.",
        "",
        INTRO,
        "",
    ]
    short = sum(1 for row in report.rows if row.run and row.run.short_mode)
    notes = [*notes] + ([f"{short} row(s) come from short (CI) runs: they do not measure."] if short else [])
    lines += [*(f"> {note}\n" for note in notes), "## Summary", ""]
    lines += table(report.rows) if report.rows else ["No results: run `nox -s bench` (or `pytest benchmarks -s`)."]
    lines.append("")
    if plots:
        lines += ["## Plots", ""]
        lines += [
            f"![{title}]({Path(os.path.relpath(path, out.parent)).as_posix()})\n" for title, path in plots.items()
        ]
    sections = report.sections()
    if sections:
        lines += ["## What each ratio means", ""]
        for section, (details, sources) in sections.items():
            lines += [f"### {section.title} (`{section.test}`)", "", section.text, ""]
            lines += [*(f"- {detail}" for detail in details), ""]
            lines += ["Source: " + ", ".join(f"`{name}`" for name in sources) + ".", ""]
    if report.results:
        lines += ["## Machine", "", *machines(report), ""]
    if report.problems:
        lines += ["## Not in this report", "", *(f"- {problem}" for problem in report.problems), ""]
    return "\n".join(lines)


def write(results: Path, out: Path, plots_dir: Path | None = None, notes: Sequence[str] = ()) -> Report:
    """Read ``results``; draw the plots into ``plots_dir`` (default: ``out`` without .md) and write the page."""
    report = collect(results)
    plots_dir = plots_dir if plots_dir is not None else out.parent / out.stem
    plots: dict[str, Path] = {}
    for kind, title in (("time", "Time, EPL / PyTorch"), ("memory", "Memory, EPL / PyTorch")):
        if data := bars(report.rows, kind):
            plot(title, data, plots_dir / f"{kind}_ratios.svg")
            plots[title] = plots_dir / f"{kind}_ratios.svg"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(report, plots, out, results, notes))
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns 0 (a report is written even when some files cannot be read)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="folder of result JSON files")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the Markdown page to write")
    parser.add_argument("--plots", type=Path, default=None, help="folder for the SVG plots (default: OUT without .md)")
    parser.add_argument("--note", action="append", default=[], help="a line to show at the top (repeatable)")
    args = parser.parse_args(argv)
    report = write(args.results, args.out, args.plots, args.note)
    skipped = f"; {len(report.problems)} file(s) skipped" if report.problems else ""
    print(f"benchmark report: {len(report.rows)} row(s) from {report.files} file(s) -> {args.out}{skipped}")
    for problem in report.problems:
        print(f"  {problem}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
