"""A real run's pipeline timeline: every stage's measured actions of the last step, drawn like a simulated one.

    engine.step(x, y)
    from epl_pipeline.recording import save_timeline
    bubble = save_timeline(engine, "timeline")   # timeline.json (Perfetto) and timeline.png

Every rank of the replica must call it (it gathers over the replica's stages); the first
rank of each replica writes the files. Times are wall-clock, so stages on different
machines line up as well as their clocks do. The picture is drawn with matplotlib (the
``plot`` extra, ``pip install 'epl-pipeline[plot]'``); without it, ask for the JSON alone
(``picture=None``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from epl.plugin_api import Action, ActionKind, EplError
from epl_pipeline.drawing import chrome_trace
from epl_pipeline.plot import picture_format, write_picture
from epl_pipeline.runner import PipelineStepRunner
from epl_pipeline.schedules import Event, bubble

_KINDS = list(ActionKind)


def _runner(engine: Any) -> PipelineStepRunner:
    runner = engine.context.step_runner
    if not isinstance(runner, PipelineStepRunner):
        raise EplError("This engine is not a pipeline: its plan has one stage (or one process).")
    return runner


def gather_timeline(engine: Any) -> list[Event]:
    """The last step's actions of every stage of this rank's replica, with measured start and end (seconds)."""
    runner = _runner(engine)
    if not runner.last_timeline:
        raise EplError("No step has run yet: call engine.step(...) before recording its timeline.")
    group = runner.topology.stage_peers  # the replica's lane: its stages, once each
    mine = torch.tensor(
        [
            [e.action.stage, _KINDS.index(e.action.kind), e.action.micro_batch, e.start, e.end]
            for e in runner.last_timeline
        ],
        dtype=torch.float64,
    )
    counts = torch.zeros(group.world_size, dtype=torch.int64)
    group.all_gather(counts, torch.tensor([len(mine)], dtype=torch.int64)).wait()
    longest = int(counts.max())
    padded = torch.zeros(longest, 5, dtype=torch.float64)
    padded[: len(mine)] = mine
    every = torch.zeros(group.world_size * longest, 5, dtype=torch.float64)
    group.all_gather(every.view(-1), padded.view(-1)).wait()
    events = []
    for member, count in enumerate(counts.tolist()):
        for row in every[member * longest : member * longest + count].tolist():
            action = Action(int(row[0]), _KINDS[int(row[1])], int(row[2]))
            events.append(Event(action, row[3], row[4]))
    return events


def save_timeline(engine: Any, prefix: str | Path, picture: str | None = ".png") -> float:
    """Write ``PREFIX.json`` (Chrome trace, for Perfetto) and ``PREFIX.png`` of the last step; return its
    measured bubble.

    ``picture``: the picture's suffix (``.svg``, ``.pdf``, ... any matplotlib writes), or None for
    the JSON alone. A picture without matplotlib, or of an unknown suffix, raises an EplError on
    every rank before anything is gathered or written.
    """
    prefix = Path(prefix)
    picture_path = None if picture is None else prefix.with_suffix("." + picture.lstrip("."))
    if picture_path is not None:
        picture_format(picture_path)
    runner = _runner(engine)
    events = gather_timeline(engine)
    lanes = runner.lanes
    _, idle = bubble(events, lanes)
    if runner.topology.stage_peers.rank == 0:
        prefix.parent.mkdir(parents=True, exist_ok=True)
        prefix.with_suffix(".json").write_text(chrome_trace(events, lanes, unit_seconds=1.0))
        if picture_path is not None:
            write_picture(events, lanes, picture_path, "measured step", measured=True)
    return idle
