"""This rank's part of a pipeline, as the plugin that keeps the stages tells the others (``ParallelContext.pipeline``).

The pipeline plugin (epl-pipeline's ``keep_local_stage`` transform) sets one record once it has kept this rank's
stages; the core and the other plugins read its fields. Without a pipeline the record holds its defaults: one stage,
the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PipelinePlacement:
    """This rank's pipeline stages, the modules they run, and how their backward runs (owned by epl-pipeline)."""

    #: This rank's pipeline stages (several with ``pipeline.stages_per_rank``); empty: one stage.
    stages: tuple[int, ...] = ()
    #: The qualified names of the modules this rank's stages run whole (their roots); the rest of the model is not
    #: called as such. Empty: the whole model runs.
    stage_modules: tuple[str, ...] = ()
    #: Whether the step runner splits each backward into input gradients and, later, weight gradients (zero-bubble
    #: schedules). A compiled block's backward is one graph that computes both, so ``compile.enabled`` keeps the
    #: blocks eager then.
    split_backward: bool = False
