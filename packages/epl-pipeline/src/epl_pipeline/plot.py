"""The timeline as a matplotlib picture (the ``plot`` extra: ``pip install 'epl-pipeline[plot]'``).

    figure = draw(events, lanes, "ZeroBubble schedule (planned)")
    save(figure, "zb.png")  # the suffix picks the format: .png, .svg, .pdf, ...

A row per lane (pipeline rank), named ``stage s`` with one stage per rank and ``rank r
(stages a, b)`` with several (stage ``s`` runs on lane ``s % lanes``). A box per action,
coloured by its kind, with its micro-batch number inside where the box is wide enough; with
several stages per rank the box says the stage and kind too, as the text drawing does
(``2F3``: stage 2's forward of micro-batch 3). Grey is idle. The x axis is simulated time (a
forward of a rank's share = 1) or, measured, milliseconds since the step's start; the title
says what is drawn and its bubble fraction. matplotlib is imported only when a picture is
asked for, and drawn on its Agg canvas (vector formats on theirs): never pyplot, no display.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from epl.plugin_api import Action, ActionKind, EplError
from epl_pipeline.drawing import stages_per_lane
from epl_pipeline.schedules import Event, bubble

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

#: What installs matplotlib for the pictures.
INSTALL_HINT = "pip install 'epl-pipeline[plot]'"


@dataclass(frozen=True)
class KindStyle:
    """How one kind of action is drawn: its name in the legend, its box colour and its text colour."""

    name: str
    colour: str
    text_colour: str


#: Per kind of action, in the legend's order.
STYLES: dict[ActionKind, KindStyle] = {
    ActionKind.FORWARD: KindStyle("forward", "#1f77b4", "white"),
    ActionKind.BACKWARD: KindStyle("backward", "#2ca02c", "white"),
    ActionKind.BACKWARD_INPUT: KindStyle("input gradient", "#9467bd", "white"),
    ActionKind.BACKWARD_WEIGHT: KindStyle("weight gradient", "#ff9f1c", "black"),
}
#: The background: where no box is, the lane is idle (the bubble).
IDLE_COLOUR = "#e4e4e4"
#: Point size of the labels inside the boxes.
BOX_FONT_SIZE = 8.0
#: Figure width in inches: at least, at most.
MIN_WIDTH, MAX_WIDTH = 6.4, 30.0
#: Figure height in inches: above and below the rows (title, axis, legend), per row, at most.
HEIGHT_MARGIN, ROW_HEIGHT, MAX_HEIGHT = 1.9, 0.42, 24.0
#: Saved raster pictures' resolution.
DPI = 150


@dataclass(frozen=True)
class Box:
    """One action's box: on ``row`` (its lane), from ``left`` for ``width`` in the picture's time unit."""

    action: Action
    row: int
    left: float
    width: float


def require_matplotlib() -> None:
    """Raise an EplError naming the fix when matplotlib (the ``plot`` extra) cannot be imported."""
    try:
        importlib.import_module("matplotlib")
    except ImportError as error:
        raise EplError(f"Drawing the timeline as a picture needs matplotlib: {INSTALL_HINT}") from error


def picture_format(path: str | Path) -> str:
    """The format matplotlib writes ``path`` in, named by its suffix (``png``, ``svg``, ``pdf``, ...).

    Raises an EplError when matplotlib is missing or does not know the suffix.
    """
    require_matplotlib()
    from matplotlib.backend_bases import FigureCanvasBase

    known = FigureCanvasBase.get_supported_filetypes()
    suffix = Path(path).suffix.lstrip(".").lower()
    if suffix not in known:
        choices = ", ".join(f".{name}" for name in sorted(known))
        raise EplError(f"Cannot write a picture to {path}: its suffix must name a format ({choices}).")
    return suffix


def draw(events: Sequence[Event], lanes: int, subject: str, *, measured: bool = False) -> Figure:
    """The timeline of ``events`` on ``lanes`` pipeline ranks as a Figure titled by ``subject``.

    ``measured``: times are wall-clock seconds (drawn in milliseconds since the first start) and
    the title's bubble is the measured one; otherwise simulated time and the simulated bubble.
    """
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not events:
        raise EplError("There is nothing to draw: the timeline has no actions.")
    boxes = _boxes(events, lanes, 1e3 if measured else 1.0)
    several = stages_per_lane(list(events), lanes) > 1
    names = row_names(events, lanes)
    heading = title(events, lanes, subject, measured=measured)
    figure = Figure(figsize=_figure_size(boxes, names, heading, several), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    _draw_boxes(axes, boxes, lanes, names)
    axes.set_xlabel("time since the step's start (ms)" if measured else "time (forward units)")
    axes.set_title(heading)
    _draw_legend(figure, {box.action.kind for box in boxes})
    figure.draw_without_rendering()  # lays the figure out: the boxes' widths in inches are known from here
    _write_labels(axes, boxes, several)
    figure.set_layout_engine("none")  # keep that layout: the labels were fitted to it
    return figure


def save(figure: Figure, path: str | Path) -> Path:
    """Write ``figure`` to ``path`` (its parent made), in the format its suffix names; return the path.

    SVG keeps its text as text (searchable, small), drawn in the viewer's sans-serif font.
    """
    path = Path(path)
    format_name = picture_format(path)
    import matplotlib

    path.parent.mkdir(parents=True, exist_ok=True)
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "epl-pipeline"}):
        figure.savefig(path, format=format_name, dpi=DPI)
    return path


def write_picture(
    events: Sequence[Event], lanes: int, path: str | Path, subject: str, *, measured: bool = False
) -> Path:
    """Draw the timeline (see ``draw``) and save it to ``path``; the suffix is checked before drawing."""
    picture_format(path)
    return save(draw(events, lanes, subject, measured=measured), path)


def title(events: Sequence[Event], lanes: int, subject: str, *, measured: bool = False) -> str:
    """``subject`` over ``4 stages x 8 micro-batches, simulated bubble 17.2%`` (``measured bubble`` when measured)."""
    _, idle = bubble(list(events), lanes)
    stages = 1 + max(event.action.stage for event in events)
    micro_batches = 1 + max(event.action.micro_batch for event in events)
    ranks = f" on {_count(lanes, 'rank')}" if stages != lanes else ""
    origin = "measured" if measured else "simulated"
    shape = f"{_count(stages, 'stage')}{ranks} x {_count(micro_batches, 'micro-batch')}"
    return f"{subject}\n{shape}, {origin} bubble {idle:.1%}"


def _count(number: int, noun: str) -> str:
    """``1 stage``, ``2 stages``; ``4 micro-batches``."""
    if number == 1:
        return f"1 {noun}"
    return f"{number} {noun}{'es' if noun.endswith('h') else 's'}"


def row_names(events: Sequence[Event], lanes: int) -> list[str]:
    """Per lane: ``stage s`` when it runs one stage, ``rank r (stages a, b)`` when several."""
    if stages_per_lane(list(events), lanes) == 1:
        return [f"stage {lane}" for lane in range(lanes)]
    stages = [sorted({e.action.stage for e in events if e.action.stage % lanes == lane}) for lane in range(lanes)]
    return [f"rank {lane} (stages {', '.join(map(str, mine))})" for lane, mine in enumerate(stages)]


def box_label(action: Action, several: bool) -> str:
    """The micro-batch number (``3``); ``2F3`` (stage 2's forward of it) when a lane runs ``several`` stages."""
    return str(action) if several else str(action.micro_batch)


def _boxes(events: Sequence[Event], lanes: int, scale: float) -> list[Box]:
    """A box per event, its times since the first start multiplied by ``scale``."""
    begin = min(event.start for event in events)
    return [Box(e.action, e.action.stage % lanes, (e.start - begin) * scale, (e.end - e.start) * scale) for e in events]


def _text_inches(text: str, points: float) -> float:
    """About how wide ``text`` is in inches at ``points`` (a digit of DejaVu Sans is 0.64 em)."""
    return len(text) * 0.64 * points / 72


def _figure_size(boxes: Sequence[Box], names: Sequence[str], heading: str, several: bool) -> tuple[float, float]:
    """(width, height) in inches: wide enough for the title and for three boxes in four to hold their label,
    within bounds."""
    span = max(box.left + box.width for box in boxes)
    needs = sorted(
        (_text_inches(box_label(box.action, several), BOX_FONT_SIZE) + 0.08) / box.width
        for box in boxes
        if box.width > 0
    )
    inches_per_unit = needs[(3 * len(needs) + 3) // 4 - 1] if needs else 0.0  # the upper quartile's need
    margin = _text_inches(max(names, key=len), 10.0) + 0.8
    least = max(MIN_WIDTH, _text_inches(max(heading.splitlines(), key=len), 12.0) * 0.9 + 0.5)
    width = min(MAX_WIDTH, max(least, margin + 1.1 * inches_per_unit * span))
    height = min(MAX_HEIGHT, HEIGHT_MARGIN + ROW_HEIGHT * len(names))
    return width, height


def _draw_boxes(axes: Axes, boxes: Sequence[Box], lanes: int, names: Sequence[str]) -> None:
    """A horizontal bar per box, coloured by kind, on a row per lane (the first on top), on an idle background."""
    for kind, style in STYLES.items():
        mine = [box for box in boxes if box.action.kind is kind]
        if mine:
            axes.barh(
                [box.row for box in mine],
                [box.width for box in mine],
                left=[box.left for box in mine],
                height=0.8,
                color=style.colour,
                edgecolor="white",
                linewidth=0.6,
            )
    axes.set_yticks(range(lanes), names)
    axes.set_ylim(lanes - 0.5, -0.5)
    axes.set_xlim(0, max(box.left + box.width for box in boxes))
    axes.set_facecolor(IDLE_COLOUR)
    axes.grid(axis="x", color="white", linewidth=0.8)
    axes.set_axisbelow(True)
    axes.tick_params(axis="y", length=0)


def _draw_legend(figure: Figure, kinds: set[ActionKind]) -> None:
    """The kinds drawn, and idle, in a row below the axes."""
    from matplotlib.patches import Patch

    handles = [Patch(color=style.colour, label=style.name) for kind, style in STYLES.items() if kind in kinds]
    handles.append(Patch(facecolor=IDLE_COLOUR, edgecolor="#b0b0b0", label="idle (bubble)"))
    figure.legend(handles=handles, loc="outside lower center", ncols=len(handles), frameon=False)


def _write_labels(axes: Axes, boxes: Sequence[Box], several: bool) -> None:
    """Each box's label at its centre, where the laid-out box is wide enough to hold it."""
    span = axes.get_xlim()[1]
    inches_per_unit = axes.get_window_extent().width / axes.figure.dpi / span
    for box in boxes:
        label = box_label(box.action, several)
        if box.width * inches_per_unit >= _text_inches(label, BOX_FONT_SIZE) + 0.06:
            axes.text(
                box.left + box.width / 2,
                box.row,
                label,
                ha="center",
                va="center",
                fontsize=BOX_FONT_SIZE,
                color=STYLES[box.action.kind].text_colour,
            )
