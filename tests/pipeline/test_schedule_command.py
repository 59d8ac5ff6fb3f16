"""`epl schedule`: the timeline as text, Chrome trace JSON and a picture (PNG here), with the bubble."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from epl.cli import make_cli


def test_schedule_command_draws_and_reports_the_bubble(tmp_path: Path) -> None:
    trace, png = tmp_path / "t.json", tmp_path / "s.png"
    result = CliRunner().invoke(
        make_cli(),
        [
            "schedule",
            "--stages",
            "4",
            "--micro-batches",
            "8",
            "--backward-cost",
            "1",
            "--trace",
            str(trace),
            "--png",
            str(png),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "stage 3: .. .. .. F0 B0 F1 B1" in result.output
    assert "bubble 0.273" in result.output
    events = json.loads(trace.read_text())["traceEvents"]
    assert len(events) == 4 * 8 * 2 and {e["tid"] for e in events} == {0, 1, 2, 3}
    assert f"picture: {png}" in result.output  # --png: an alias of --picture
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_schedule_lists_the_registered_ones() -> None:
    result = CliRunner().invoke(make_cli(), ["schedule", "--stages", "2", "--micro-batches", "2", "--strategy", "Zig"])
    assert result.exit_code == 2 and "PreferBackward, PreferForward" in result.output


def test_schedule_command_draws_the_lanes_of_an_interleaved_schedule(tmp_path: Path) -> None:
    trace = tmp_path / "t.json"
    arguments = ["schedule", "--stages", "8", "--stages-per-rank", "2", "--micro-batches", "8"]
    result = CliRunner().invoke(make_cli(), [*arguments, "--strategy", "Interleaved1F1B", "--trace", str(trace)])
    assert result.exit_code == 0, result.output
    assert "lane 0: 0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 0F4" in result.output
    assert "lane 3: ... ... ... 3F0 3F1 3F2 3F3 7F0 7B0 7B0 7F1" in result.output
    assert "Interleaved1F1B: 8 stages on 4 pipeline ranks (2 per rank) x 8 micro-batches" in result.output
    assert "makespan 28.5, bubble 0.158 (interleaved 1F1B theory (P-1)/(v*M+P-1) = 0.158)" in result.output
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["tid"] for e in events} == {0, 1, 2, 3} and events[0]["name"] == "forward 0 (stage 0)"
    result = CliRunner().invoke(make_cli(), arguments)
    assert result.exit_code == 2 and "needs a schedule that runs several stages per rank" in result.output
