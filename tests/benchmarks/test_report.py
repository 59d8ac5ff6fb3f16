"""benchmarks/harness.py's result rows and benchmarks/report.py on them (no benchmark runs).

The fixtures in fixtures/ are row files as :func:`benchmarks.harness.record` writes them:
the rows of the full run of 2026-11-22 that docs/benchmarks.md shows.
"""

from __future__ import annotations

import json
import re
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from benchmarks.harness import Ratio, ResultRow, Section

from benchmarks import harness, report

FIXTURES = Path(__file__).parent / "fixtures"
SVG = "{http://www.w3.org/2000/svg}"
#: Rows each fixture holds.
ROWS_PER_FILE = {
    "all_reduce_bandwidth.json": 6,
    "amp.json": 2,
    "checkpoint.json": 2,
    "checkpointing.json": 2,
    "data_parallel_vs_ddp.json": 1,
    "launch_to_ready_vs_torchrun.json": 1,
    "local_step_m1.json": 1,
    "local_step_m4.json": 1,
    "pipeline_vs_torch_pipelining.json": 6,
    "split_cross_entropy_vs_gathered.json": 1,
    "split_mlp_vs_dtensor.json": 1,
    "zero_v0_vs_torch.json": 1,
    "zero_v1_vs_torch.json": 2,
    "zero_v2_vs_torch.json": 1,
}
SECTION = Section("Things", "benchmarks/test_things.py", "What *things* measure.")


@pytest.fixture
def results(tmp_path: Path) -> Path:
    folder = tmp_path / "results"
    shutil.copytree(FIXTURES, folder)
    return folder


@pytest.fixture
def recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty results folder that :func:`harness.record` writes into."""
    monkeypatch.setattr(harness, "RESULTS", tmp_path / "recorded")
    return tmp_path / "recorded"


def table_rows(page: str) -> list[list[str]]:
    """The summary table's body rows, split into cells."""
    lines = page.split("## Summary", 1)[1].split("\n## ", 1)[0].splitlines()
    body = [line for line in lines if line.startswith("| ") and not line.startswith("| Feature")]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in body]


def run(results: Path, tmp_path: Path, *notes: str) -> tuple[str, Path]:
    out = tmp_path / "docs" / "benchmarks.md"
    args = ["--results", str(results), "--out", str(out), *(arg for note in notes for arg in ("--note", note))]
    assert report.main(args) == 0
    return out.read_text(), out.parent / "benchmarks"


def test_rows_of_every_file(results: Path) -> None:
    collected = report.collect(results)
    assert not collected.problems and collected.files == len(ROWS_PER_FILE)
    assert {name: len(result.rows) for name, result in collected.results} == ROWS_PER_FILE
    amp = dict(collected.results)["amp.json"]
    assert amp.version == harness.VERSION and amp.section.test == "benchmarks/test_amp.py"
    assert [row.against for row in amp.rows] == ["`torch.autocast` + `GradScaler`", "float32 PyTorch (no AMP)"]
    assert amp.rows[1].time == (Ratio(13.31),)
    assert amp.rows[1].memory == (Ratio(0.59, "step peak"), Ratio(0.64, "activations"))
    assert all(row.run is not None and row.run.mode == "full" for row in collected.rows)
    assert len(amp.details) == 3 and amp.details[0].startswith("step time: EPL 2433.2 ms")


def test_summary_table(results: Path, tmp_path: Path) -> None:
    page, _ = run(results, tmp_path)
    rows = table_rows(page)
    assert len(rows) == sum(ROWS_PER_FILE.values())
    assert all(len(row) == 7 for row in rows), rows
    assert all(row[2] != "—" for row in rows)  # every row has a time ratio
    by_key = {(row[0], row[1]): row for row in rows}
    checkpointing = by_key[("Gradient checkpointing `auto`, 12 layers", "no checkpointing")]
    assert checkpointing[2:] == [
        "1.48",
        "activations 0.090, step peak 0.16",
        "full",
        "2026-11-22 22:01",
        "AMD EPYC, 2 cores, torch 2.13.0+cpu",
    ]
    assert by_key[("Data-parallel step, 2 processes", "`DistributedDataParallel`")][2:4] == ["0.85", "—"]
    # Rows come section by section, in the order of their benchmarks' files.
    assert rows[0][0] == "AMP O1, 4-layer transformer" and rows[-1][0].startswith("ZeRO v2")


def test_a_section_per_benchmark_with_its_details(results: Path, tmp_path: Path) -> None:
    page, _ = run(results, tmp_path, "One full run.")
    assert "> One full run." in page.split("## Summary")[0]
    titles = re.findall(r"^### (.*)$", page, flags=re.MULTILINE)
    assert len(titles) == 11 and "Local step (`benchmarks/test_local_step.py`)" in titles
    local = page.split("### Local step", 1)[1].split("\n### ", 1)[0]
    assert "The ratio is EPL's own overhead; target <= 1.03." in local
    assert "- 1 micro-batch: PyTorch 5.77 ms, EPL 6.22 ms, ratio 1.071 (median of 40 rounds x 20 calls)" in local
    assert "- 4 micro-batches: PyTorch 13.8 ms" in local
    assert "Source: `local_step_m1.json`, `local_step_m4.json`." in local
    machine = page.split("## Machine", 1)[1]
    assert "- **AMD EPYC, 2 cores, torch 2.13.0+cpu**: CPU AMD EPYC; 2 logical cores (2 usable)" in machine
    assert "14 result file(s), recorded 2026-11-22 22:00 to 2026-11-22 22:08 UTC." in machine
    assert "## Not in this report" not in page


def test_plots_are_svg_with_the_labels_and_the_line_at_one(results: Path, tmp_path: Path) -> None:
    page, plots = run(results, tmp_path)
    rows = report.collect(results).rows
    for kind, name in (("time", "Time, EPL / PyTorch"), ("memory", "Memory, EPL / PyTorch")):
        path = plots / f"{kind}_ratios.svg"
        assert f"![{name}](benchmarks/{kind}_ratios.svg)" in page
        root = ET.parse(path).getroot()
        assert root.tag == f"{SVG}svg"
        texts = {"".join(text.itertext()) for text in root.iter(f"{SVG}text")}
        bars = report.bars(rows, kind)
        assert len(bars) == sum(len(getattr(row, kind)) for row in rows) > 0
        assert {label for label, _ in bars} <= texts, sorted({label for label, _ in bars} - texts)
        assert name in texts and any(text.startswith("EPL / PyTorch, log scale") for text in texts)
        groups = {group.get("id"): group for group in root.iter(f"{SVG}g")}
        assert sum(1 for gid in groups if gid and gid.startswith("bar-")) == len(bars)
        # The line at 1.0 is vertical, at the x of the tick labelled 1.
        (x1, _), (x2, _) = _points(groups["line-1.0"])
        assert x1 == pytest.approx(x2)
        tick = next(text for text in root.iter(f"{SVG}text") if text.text == "1")
        assert float(tick.get("x")) == pytest.approx(x1, abs=0.5)
    assert "13.31" in (plots / "time_ratios.svg").read_text()


def test_plot_labels_are_not_cut_off(results: Path, tmp_path: Path) -> None:
    _, plots = run(results, tmp_path)
    for name in ("time_ratios.svg", "memory_ratios.svg"):
        root = ET.parse(plots / name).getroot()
        width = float(root.get("viewBox").split()[2])
        for text in root.iter(f"{SVG}text"):
            # At least 0.45 em a character at the font's 10 px: a lower bound of the text's width.
            least, x = 4.5 * len("".join(text.itertext())), float(text.get("x"))
            start = {"end": x - least, "middle": x - least / 2}.get(_anchor(text), x)
            assert 0 <= start and start + least <= width, (name, text.text, x, width)


def _anchor(text: ET.Element) -> str:
    found = re.search(r"text-anchor: (\w+)", text.get("style", ""))
    return found.group(1) if found else "start"


def _points(group: ET.Element) -> list[tuple[float, float]]:
    path = next(group.iter(f"{SVG}path")).get("d")
    numbers = [float(n) for n in re.findall(r"-?\d+(?:\.\d+)?", path)]
    return list(zip(numbers[::2], numbers[1::2], strict=True))


def test_plot_survives_odd_values(tmp_path: Path) -> None:
    path = tmp_path / "odd.svg"
    report.plot("odd <&> values", [("zero", 0.0), ("nan", float("nan")), ("tiny", 1e-3), ("big", 300.0)], path)
    root = ET.parse(path).getroot()
    texts = {"".join(text.itertext()) for text in root.iter(f"{SVG}text")}
    assert {"odd <&> values", "tiny", "big", "0.001", "300.00"} <= texts and not {"zero", "nan"} & texts


def test_compare_records_a_row(recorded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    row = ResultRow("Summing", "`sum`", memory=(Ratio(0.5, "held"),), plot="sum vs sum")
    result = harness.compare(
        "sum_vs_sum",
        lambda: sum(range(200)),
        lambda: sum(range(200)),
        rounds=3,
        calls_per_round=2,
        row=row,
        section=SECTION,
    )
    assert capsys.readouterr().out.startswith("sum_vs_sum: PyTorch ")
    loaded = harness.load(recorded / "sum_vs_sum.json")
    assert loaded.name == "sum_vs_sum" and loaded.section == SECTION
    assert loaded.details == (result.detail(),) and "(median of 3 rounds x 2 calls)" in result.detail()
    (written,) = loaded.rows
    assert written.time == (Ratio(result.ratio),) and written.memory == row.memory and written.plot == row.plot
    assert written.run is not None and written.run.short_mode is harness.short_mode()
    assert written.run.machine["cores"] >= 1 and written.run.machine["torch"]
    # Without a row, or on a process that does not save, compare() records nothing.
    harness.compare("unrecorded", lambda: None, lambda: None, rounds=1, calls_per_round=1)
    harness.compare(
        "silent", lambda: None, lambda: None, rounds=1, calls_per_round=1, save=False, row=row, section=SECTION
    )
    assert sorted(path.name for path in recorded.iterdir()) == ["sum_vs_sum.json"]
    page, _ = run(recorded, tmp_path)
    label = report.machine_label(written.run)
    assert table_rows(page) == [
        [
            "Summing",
            "`sum`",
            f"{result.ratio:.2f}",
            "held 0.50",
            written.run.mode,
            report.date_label(written.run),
            label,
        ]
    ]
    assert "### Things (`benchmarks/test_things.py`)\n\nWhat *things* measure.\n\n- PyTorch " in page


def test_record_writes_the_rows_of_one_schema(recorded: Path) -> None:
    rows = [ResultRow("A", "B", time=(Ratio(1, "x"), Ratio(2.5, "y"))), ResultRow("C", "D", memory=[Ratio(0.25)])]
    path = harness.record("pair", rows, section=SECTION, details=["one", "two"])
    data = json.loads(path.read_text())
    assert list(data) == ["version", "name", "section", "rows", "details"] and data["version"] == harness.VERSION
    assert data["rows"][0]["time"] == [{"value": 1.0, "label": "x"}, {"value": 2.5, "label": "y"}]
    assert set(data["rows"][1]["run"]) == {"date", "short_mode", "machine"}
    loaded = harness.load(path)
    assert [(row.feature, row.time, row.memory) for row in loaded.rows] == [
        ("A", (Ratio(1.0, "x"), Ratio(2.5, "y")), ()),
        ("C", (), (Ratio(0.25),)),
    ]
    assert loaded.details == ("one", "two") and loaded.rows[0].run == loaded.rows[1].run


def test_rows_are_typed() -> None:
    with pytest.raises(TypeError):
        ResultRow("A", "B", time=(1.5,))
    with pytest.raises(TypeError):
        ResultRow("A", None)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Ratio("fast")  # type: ignore[arg-type]
    assert Ratio(0.0901).text() == "0.090" and Ratio(13.314, "peak").text() == "peak 13.31"
    assert ResultRow("`epl launch`", "`torchrun`").label() == "epl launch vs torchrun"


def test_short_mode_rows_are_marked(recorded: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    harness.record("full_one", [ResultRow("Full", "X", time=(Ratio(1.2),))], section=SECTION)
    monkeypatch.setattr(harness, "_SHORT", True)
    harness.record("short_one", [ResultRow("Short", "X", time=(Ratio(0.8),))], section=SECTION)
    page, plots = run(recorded, tmp_path)
    assert [row[4] for row in table_rows(page)] == ["full", "short"]
    assert "> 1 row(s) come from short (CI) runs: they do not measure." in page.split("## Summary")[0]
    svg = (plots / "time_ratios.svg").read_text()
    assert "Short vs X (short run)" in svg and "Full vs X (short run)" not in svg and "Full vs X" in svg
    assert not (plots / "memory_ratios.svg").exists()


def test_unreadable_and_unknown_files_get_a_line(results: Path, tmp_path: Path) -> None:
    good = json.loads((results / "amp.json").read_text())
    (results / "broken.json").write_text('{"version": 1,')
    (results / "binary.json").write_bytes(b"\xff\xfe\x00")
    (results / "old_format.json").write_text(json.dumps({"baseline_s": 1.0, "epl_s": 2.0, "ratio": 2.0}))
    (results / "a_list.json").write_text("[1, 2]")
    (results / "future.json").write_text(json.dumps({**good, "version": 2}))
    (results / "no_rows.json").write_text(json.dumps({key: value for key, value in good.items() if key != "rows"}))
    bad_ratio = json.loads(json.dumps(good))
    bad_ratio["rows"][0]["time"][0]["value"] = "fast"
    (results / "bad_ratio.json").write_text(json.dumps(bad_ratio))
    bad_run = json.loads(json.dumps(good))
    bad_run["rows"][1]["run"]["date"] = 5
    (results / "bad_run.json").write_text(json.dumps(bad_run))
    page, _ = run(results, tmp_path)
    problems = page.split("## Not in this report", 1)[1]
    assert "- `broken.json`: not readable as JSON (JSONDecodeError" in problems
    assert "- `binary.json`: not readable as JSON (UnicodeDecodeError" in problems
    assert (
        "- `old_format.json`: not a result file of version 1 (found None); run its benchmark again; skipped."
        in problems
    )
    assert "- `a_list.json`: not a result file of version 1 (found list)" in problems
    assert "- `future.json`: not a result file of version 1 (found 2)" in problems
    assert "- `no_rows.json`: unexpected content (KeyError: 'rows'); skipped." in problems
    assert "- `bad_ratio.json`: unexpected content (ValueError" in problems
    assert "- `bad_run.json`: unexpected content (TypeError" in problems
    assert len(re.findall(r"^- `", problems, flags=re.MULTILINE)) == 8
    # The rest is still reported.
    assert len(table_rows(page)) == sum(ROWS_PER_FILE.values())


def test_no_results(tmp_path: Path) -> None:
    page, plots = run(tmp_path / "nowhere", tmp_path)
    assert "No results: run `nox -s bench`" in page and "from 0 file(s)" in page
    assert "## Plots" not in page and not plots.exists()
