"""`epl schedule`: the timeline as text, Chrome trace JSON and PNG, with the bubble."""

from __future__ import annotations

import json
import struct
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
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (960, 4 * 24)


def test_unknown_schedule_lists_the_registered_ones() -> None:
    result = CliRunner().invoke(make_cli(), ["schedule", "--stages", "2", "--micro-batches", "2", "--strategy", "Zig"])
    assert result.exit_code == 2 and "PreferBackward, PreferForward" in result.output
