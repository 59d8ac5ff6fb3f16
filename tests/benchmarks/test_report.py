"""benchmarks/report.py on fixture results (no benchmark runs): table rows, SVG plots, bad files.

The fixtures in fixtures/ are result files as the benchmarks wrote them; local_step_m1.json
carries the ``"run"`` block the harness now adds, the others were saved before it existed.
"""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from benchmarks import harness, report

FIXTURES = Path(__file__).parent / "fixtures"
SVG = "{http://www.w3.org/2000/svg}"
#: Rows each fixture gives (the claimed compare() files give none: amp.json and checkpointing.json hold them).
ROWS_PER_FILE = {
    "local_step_m1.json": 1,
    "local_step_m4.json": 1,
    "launch_to_ready_vs_torchrun.json": 1,
    "data_parallel_vs_ddp.json": 1,
    "all_reduce_bandwidth.json": 3,
    "amp.json": 2,
    "checkpointing.json": 2,
    "pipeline_vs_torch_pipelining.json": 3,
    "split_mlp_vs_dtensor.json": 1,
    "split_cross_entropy_vs_gathered.json": 1,
    "zero_v0_vs_torch.json": 1,
    "zero_v1_vs_torch.json": 2,
    "zero_v2_vs_torch.json": 1,
    "checkpoint.json": 2,
}


@pytest.fixture
def results(tmp_path: Path) -> Path:
    folder = tmp_path / "results"
    shutil.copytree(FIXTURES, folder)
    return folder


def table_rows(page: str) -> list[list[str]]:
    """The summary table's body rows, split into cells."""
    lines = page.split("## Summary", 1)[1].split("\n## ", 1)[0].splitlines()
    body = [line for line in lines if line.startswith("| ") and not line.startswith("| Feature")]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in body]


def run(results: Path, tmp_path: Path) -> tuple[str, Path]:
    out = tmp_path / "docs" / "benchmarks.md"
    assert report.main(["--results", str(results), "--out", str(out)]) == 0
    return out.read_text(), out.parent / "benchmarks"


def test_a_row_per_comparison_of_every_result(results: Path, tmp_path: Path) -> None:
    page, _ = run(results, tmp_path)
    rows = table_rows(page)
    assert len(rows) == sum(ROWS_PER_FILE.values())
    assert all(len(row) == 7 for row in rows), rows
    collected = report.collect(results)
    per_file = {name: sum(row.source == name for row in collected.rows) for name in ROWS_PER_FILE}
    assert per_file == ROWS_PER_FILE
    assert not collected.problems and not collected.missing
    # Every row has a time ratio; the memory benchmarks have memory ratios.
    assert all(row[2] != "—" for row in rows)
    amp = [row for row in rows if row[0].startswith("AMP O1")]
    assert [row[1] for row in amp] == ["`torch.autocast` + `GradScaler`", "float32 PyTorch (no AMP)"]
    assert amp[0][3] == "step peak 1.00, activations 1.00" and amp[1][2] == "12.64"
    # A section per benchmark says what its ratios mean.
    for title in ("Local step", "AMP O1", "Gradient checkpointing", "Pipeline", "ZeRO", "all_reduce by message size"):
        assert f"### {title} (`benchmarks/test_" in page


def test_mode_date_and_machine_from_the_run_block(results: Path, tmp_path: Path) -> None:
    rows = {(row[0], row[1]): row for row in table_rows(run(results, tmp_path)[0])}
    recorded = rows[("Local `engine.step`, 1 micro-batch", "plain PyTorch loop (same model and optimizer)")]
    assert recorded[4:] == ["full", "2026-11-22 21:00", "AMD EPYC, 2 cores, torch 2.13.0+cpu"]
    legacy = rows[("`epl launch` to 2 ranks ready", "`torchrun`")]
    assert legacy[4] == "?" and legacy[5].endswith("(file time)") and legacy[6] == "?"
    zero = rows[("ZeRO v2 (states + gradients + parameters), 2 processes", "FSDP2 `fully_shard`")]
    assert zero[4] == "full"  # from the benchmark's own short_mode key


def test_plots_are_svg_with_a_bar_per_ratio(results: Path, tmp_path: Path) -> None:
    page, plots = run(results, tmp_path)
    collected = report.collect(results)
    expected = {
        "time_ratios.svg": sum(len(row.time) for row in collected.rows),
        "memory_ratios.svg": sum(len(row.memory) for row in collected.rows),
    }
    for name, bars in expected.items():
        root = ET.parse(plots / name).getroot()
        assert root.tag == f"{SVG}svg"
        assert len([rect for rect in root.iter(f"{SVG}rect") if rect.find(f"{SVG}title") is not None]) == bars
        assert f"](benchmarks/{name})" in page


def test_unknown_and_malformed_files_get_a_line(results: Path, tmp_path: Path) -> None:
    (results / "broken.json").write_text('{"ratio": 1.0,')
    (results / "mystery.json").write_text(json.dumps({"speedup": 2.0}))
    (results / "a_list.json").write_text("[1, 2]")
    (results / "amp.json").write_text(json.dumps({"layers": 4}))  # a known name with the wrong content
    (results / "pipeline_vs_torch_pipelining.json").write_text("[]")
    (results / "local_step_m4.json").write_text(json.dumps({"ratio": "fast", "baseline_s": 1, "epl_s": 1}))
    garbage_run = {"date": 5, "machine": "a box", "short_mode": None}
    (results / "odd_vs_torch.json").write_text(
        json.dumps({"baseline_s": 1.0, "epl_s": 2.0, "ratio": 2.0, "run": garbage_run})
    )
    page, _ = run(results, tmp_path)
    missing = page.split("## Not in this report", 1)[1]
    assert "`broken.json`: not readable as JSON (JSONDecodeError" in missing
    assert "`mystery.json`: not a result this report knows (keys: speedup); skipped." in missing
    assert "`a_list.json`: not a result this report knows (keys: list)" in missing
    assert "`amp.json`: unexpected content for benchmarks/test_amp.py (KeyError" in missing
    assert "`pipeline_vs_torch_pipelining.json`: expected a JSON object, found list" in missing
    assert "`local_step_m4.json`: unexpected content for benchmarks/test_local_step.py (ValueError" in missing
    assert "| `odd_vs_torch` | PyTorch (see the benchmark) | 2.00 | — | ? | 5 | ? |" in page
    # The rest is still reported; amp.json's compare() files, no longer claimed, get rows of their own.
    sources = {row.source for row in report.collect(results).rows}
    assert {"amp_vs_torch_amp.json", "amp_vs_float32.json", "zero_v1_vs_torch.json"} <= sources
    assert "amp.json" not in sources and "### Other comparisons" in page


def test_no_results(tmp_path: Path) -> None:
    page, plots = run(tmp_path / "nowhere", tmp_path)
    assert "No results: run `nox -s bench`" in page
    assert "- `zero_v2_vs_torch.json`: no result (run `benchmarks/test_zero.py`)." in page
    assert not plots.exists()


def test_bar_chart_survives_odd_values() -> None:
    svg = report.bar_chart("odd <&> values", [("zero", 0.0), ("nan", float("nan")), ("tiny", 1e-3), ("big", 300.0)])
    root = ET.fromstring(svg)
    assert len([r for r in root.iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None]) == 2
    assert ET.fromstring(report.bar_chart("empty", [])).tag == f"{SVG}svg"


def test_harness_records_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(harness, "RESULTS", tmp_path)
    harness.save_result("thing_vs_torch", {"name": "thing_vs_torch", "baseline_s": 2.0, "epl_s": 1.0, "ratio": 0.5})
    data = json.loads((tmp_path / "thing_vs_torch.json").read_text())
    assert data["ratio"] == 0.5 and data["run"]["short_mode"] is harness.short_mode()
    machine = data["run"]["machine"]
    assert machine["cores"] >= 1 and machine["cpu"] and machine["torch"]
    rows = report.collect(tmp_path).rows
    assert [(row.feature, row.time[0].value, row.machine == report.machine_label(machine)) for row in rows] == [
        ("`thing_vs_torch`", 0.5, True)
    ]
