"""The timeline drawn with matplotlib (epl_pipeline.plot): rows, boxes, labels, axis, title, legend, files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from epl.cli import make_cli
from epl.errors import EplError
from epl.interfaces.schedule import Action, ActionKind
from epl_pipeline.plot import INSTALL_HINT, STYLES, draw, save
from epl_pipeline.recording import save_timeline
from epl_pipeline.schedules import SCHEDULES, Event, bubble, build, timeline

F, B = ActionKind.FORWARD, ActionKind.BACKWARD

#: (strategy, stages, stages per rank, micro-batches, the row names, the legend).
PLANNED = [
    (
        "PreferBackward",
        4,
        1,
        8,
        ["stage 0", "stage 1", "stage 2", "stage 3"],
        ["forward", "backward", "idle (bubble)"],
    ),
    (
        "ZeroBubble",
        4,
        1,
        8,
        ["stage 0", "stage 1", "stage 2", "stage 3"],
        ["forward", "input gradient", "weight gradient", "idle (bubble)"],
    ),
    (
        "Interleaved1F1B",
        8,
        2,
        8,
        ["rank 0 (stages 0, 4)", "rank 1 (stages 1, 5)", "rank 2 (stages 2, 6)", "rank 3 (stages 3, 7)"],
        ["forward", "backward", "idle (bubble)"],
    ),
]


def planned(strategy: str, stages: int, per_rank: int, micro: int) -> tuple[list[Event], int]:
    schedule = build(strategy, SCHEDULES, stages, micro, per_rank)
    return timeline(schedule, 1.0, 2.0), len(schedule)


def corner(x: float, y: float) -> tuple[float, float]:
    return round(x, 6), round(y, 6)


@pytest.mark.parametrize(("strategy", "stages", "per_rank", "micro", "rows", "legend"), PLANNED)
def test_a_planned_schedule_is_drawn_a_row_per_lane_and_a_labelled_box_per_action(
    strategy: str, stages: int, per_rank: int, micro: int, rows: list[str], legend: list[str]
) -> None:
    from matplotlib.colors import to_rgba

    events, lanes = planned(strategy, stages, per_rank, micro)
    figure = draw(events, lanes, f"{strategy} schedule (planned)")
    axes = figure.axes[0]
    assert [label.get_text() for label in axes.get_yticklabels()] == rows
    boxes = {
        corner(r.get_x(), r.get_y() + r.get_height() / 2): (round(r.get_width(), 6), r.get_facecolor())
        for r in axes.patches
    }
    assert len(axes.patches) == len(boxes) == len(events)
    for event in events:
        width, colour = boxes[corner(event.start, event.action.stage % lanes)]
        assert width == round(event.end - event.start, 6)
        assert colour == to_rgba(STYLES[event.action.kind].colour)
    labels = {corner(*text.get_position()): text.get_text() for text in axes.texts}
    expected = str if per_rank > 1 else (lambda action: str(action.micro_batch))
    assert labels == {
        corner((e.start + e.end) / 2, e.action.stage % lanes): expected(e.action) for e in events
    }  # every box is wide enough for its label
    assert set(labels.values()) >= ({str(m) for m in range(micro)} if per_rank == 1 else {"2F3"})
    assert axes.get_xlabel() == "time (forward units)"
    assert axes.get_xlim() == (0.0, max(e.end for e in events))
    _, idle = bubble(events, lanes)
    assert axes.get_title() == (
        f"{strategy} schedule (planned)\n{stages} stages{f' on {lanes} ranks' if per_rank > 1 else ''} "
        f"x {micro} micro-batches, simulated bubble {idle:.1%}"
    )
    assert [text.get_text() for text in figure.legends[0].get_texts()] == legend


def test_a_measured_step_is_drawn_in_milliseconds_with_its_measured_bubble() -> None:
    clock = 1_700_000_000.0  # wall-clock seconds, as the runner records them
    events = [
        Event(Action(0, F, 0), clock, clock + 0.002),
        Event(Action(1, F, 0), clock + 0.003, clock + 0.005),
        Event(Action(1, B, 0), clock + 0.005, clock + 0.009),
        Event(Action(0, B, 0), clock + 0.010, clock + 0.014),
    ]
    figure = draw(events, 2, "measured step", measured=True)
    axes = figure.axes[0]
    assert axes.get_xlabel() == "time since the step's start (ms)"
    assert axes.get_xlim() == pytest.approx((0.0, 14.0), abs=1e-3)
    assert [r.get_x() for r in axes.patches] == pytest.approx([0.0, 3.0, 5.0, 10.0], abs=1e-3)
    assert axes.get_title() == "measured step\n2 stages x 1 micro-batch, measured bubble 57.1%"
    assert bubble(events, 2)[1] == pytest.approx(1 - 12 / (2 * 14), abs=1e-4)


def test_the_picture_is_saved_in_the_format_its_suffix_names(tmp_path: Path) -> None:
    events, lanes = planned("ZeroBubble", 2, 1, 4)
    figure = draw(events, lanes, "ZeroBubble schedule (planned)")
    assert save(figure, tmp_path / "deep" / "zb.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert save(figure, tmp_path / "zb.pdf").read_bytes().startswith(b"%PDF")
    svg = save(figure, tmp_path / "zb.svg").read_text()
    assert "<svg" in svg and "ZeroBubble schedule (planned)" in svg and "weight gradient" in svg
    with pytest.raises(EplError, match=r"zb\.doc: its suffix must name a format \(.*\.png.*\.svg"):
        save(figure, tmp_path / "zb.doc")


def test_the_schedule_command_writes_any_picture_format(tmp_path: Path) -> None:
    picture = tmp_path / "zb.svg"
    arguments = ["schedule", "--stages", "4", "--micro-batches", "8", "--strategy", "ZeroBubble"]
    result = CliRunner().invoke(make_cli(), [*arguments, "--picture", str(picture)])
    assert result.exit_code == 0, result.output
    assert f"picture: {picture}" in result.output
    assert "simulated bubble 17.2%" in picture.read_text()
    result = CliRunner().invoke(make_cli(), [*arguments, "--picture", str(tmp_path / "zb.doc")])
    assert result.exit_code == 2 and "its suffix must name a format" in result.output


def test_without_matplotlib_a_picture_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails, as when not installed
    events, lanes = planned("PreferBackward", 2, 1, 2)
    with pytest.raises(EplError, match="needs matplotlib") as raised:
        draw(events, lanes, "planned")
    assert str(raised.value) == "Drawing the timeline as a picture needs matplotlib: pip install 'epl-pipeline[plot]'"
    with pytest.raises(EplError, match="needs matplotlib"):
        save_timeline(object(), tmp_path / "timeline")  # before the engine is looked at or anything gathered
    assert not list(tmp_path.iterdir())
    arguments = ["schedule", "--stages", "2", "--micro-batches", "2"]
    result = CliRunner().invoke(make_cli(), [*arguments, "--png", str(tmp_path / "s.png")])
    assert result.exit_code == 2 and INSTALL_HINT in result.output and not list(tmp_path.iterdir())
    result = CliRunner().invoke(make_cli(), [*arguments, "--trace", str(tmp_path / "t.json")])
    assert result.exit_code == 0 and (tmp_path / "t.json").exists()  # the text and trace need no matplotlib


def test_importing_the_pipeline_plugin_does_not_import_matplotlib() -> None:
    code = (
        "import sys, epl.cli, epl_pipeline.command, epl_pipeline.plot, epl_pipeline.recording; epl.cli.make_cli(); "
        "print('matplotlib' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert result.stdout.strip() == "False"
