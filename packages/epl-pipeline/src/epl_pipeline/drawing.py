"""Drawings of a schedule's timeline: text, Chrome trace JSON (Perfetto) and PNG (no dependencies).

Each draws a row per lane (pipeline rank): stage ``s`` runs on lane ``s % lanes``. With one
stage per rank a lane is a stage; with several, the labels name the stage too.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

from epl.plugin_api import Action, ActionKind
from epl_pipeline.schedules import Event

#: RGB per action kind in the PNG.
COLOURS = {
    ActionKind.FORWARD: (66, 133, 244),
    ActionKind.BACKWARD: (52, 168, 83),
    ActionKind.BACKWARD_INPUT: (52, 168, 83),
    ActionKind.BACKWARD_WEIGHT: (251, 188, 5),
}
IDLE = (235, 235, 235)


def stages_per_lane(events: list[Event], lanes: int) -> int:
    """``v``, the stages each of the ``lanes`` runs: (1 + the highest stage in ``events``) // ``lanes``."""
    return max(1, (1 + max(e.action.stage for e in events)) // lanes)


def _label(action: Action, several: bool) -> str:
    """``F3`` (forward of micro-batch 3); ``2F3`` (on stage 2) when a lane runs ``several`` stages."""
    return str(action) if several else f"{action.kind.value}{action.micro_batch}"


def text(events: list[Event], lanes: int) -> str:
    """One row per lane, one column per time unit: ``F3`` forward of micro-batch 3 (``2F3``: on stage 2,
    when a lane runs several stages), dots idle. Rows are named ``stage s`` with one stage per lane,
    ``lane r`` otherwise."""
    several = stages_per_lane(events, lanes) > 1
    unit = min(e.end - e.start for e in events)
    slots = round(max(e.end for e in events) / unit)
    width = max(len(_label(e.action, several)) for e in events)
    rows = [["." * width] * slots for _ in range(lanes)]
    for event in events:
        label = _label(event.action, several).ljust(width)
        for slot in range(round(event.start / unit), round(event.end / unit)):
            rows[event.action.stage % lanes][slot] = label
    name = "lane" if several else "stage"
    return "\n".join(f"{name} {r}: " + " ".join(row) for r, row in enumerate(rows))


def chrome_trace(events: list[Event], lanes: int | None = None, unit_seconds: float = 1e-3) -> str:
    """The timeline as Chrome trace JSON: open it in Perfetto (ui.perfetto.dev) or chrome://tracing.

    A thread per lane (``lanes``; None: one stage per lane); with several stages per lane the
    names say the stage. Event times are in units of ``unit_seconds`` (a millisecond per
    simulated unit; 1.0 for measured seconds).
    """
    lanes = lanes or 1 + max(e.action.stage for e in events)
    several = stages_per_lane(events, lanes) > 1
    begin = min(e.start for e in events)
    trace = [
        {
            "name": f"{e.action.kind.name.lower()} {e.action.micro_batch}"
            + (f" (stage {e.action.stage})" if several else ""),
            "ph": "X",
            "ts": (e.start - begin) * 1e6 * unit_seconds,
            "dur": (e.end - e.start) * 1e6 * unit_seconds,
            "pid": 0,
            "tid": e.action.stage % lanes,
            "args": {"micro_batch": e.action.micro_batch, "stage": e.action.stage},
        }
        for e in events
    ]
    return json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"})


def png(events: list[Event], lanes: int, path: Path, width: int = 960, row_height: int = 24) -> None:
    """Write the timeline as a PNG ``width`` pixels wide: a row per lane (stage ``s`` on row ``s % lanes``),
    blue forwards, green backwards (or input gradients), yellow weight gradients, grey bubbles."""
    begin = min(e.start for e in events)
    scale = width / (max(e.end for e in events) - begin)
    height = lanes * row_height
    image = [[IDLE] * width for _ in range(height)]
    for e in events:
        colour = COLOURS[e.action.kind]
        x0, x1 = round((e.start - begin) * scale), round((e.end - begin) * scale)
        y0 = e.action.stage % lanes * row_height
        for y in range(y0 + 2, y0 + row_height - 2):
            for x in range(x0 + 1, min(width, max(x0 + 2, x1 - 1))):
                image[y][x] = colour
    raw = b"".join(b"\x00" + bytes(v for pixel in row for v in pixel) for row in image)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")
    )
