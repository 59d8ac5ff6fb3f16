"""Drawings of a schedule's timeline with no dependencies: text and Chrome trace JSON (Perfetto).

Each draws a row per lane (pipeline rank): stage ``s`` runs on lane ``s % lanes``. With one
stage per rank a lane is a stage; with several, the labels name the stage too. The picture
(matplotlib, the ``plot`` extra) is ``epl_pipeline.plot``.
"""

from __future__ import annotations

import json

from epl.plugin_api import Action
from epl_pipeline.schedules import Event


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
