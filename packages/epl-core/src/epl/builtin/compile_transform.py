"""The model transform of ``compile.enabled``: compile each repeated block after every other transform
(:mod:`epl.compiling`)."""

from __future__ import annotations

import logging

from torch import nn

from epl.compiling import CompileReport, CompileState, compile_blocks, repeated_blocks, without_kv_cache
from epl.config.settings import CoreSettings
from epl.interfaces.phases import TransformPhase
from epl.plugins.context import ParallelContext

_log = logging.getLogger("epl.compile")
SPLIT_BACKWARD = (
    "the pipeline schedule splits each backward into input and weight gradients (zero bubble), and a compiled "
    "block's backward is one graph that computes both, so it would run twice; pipeline.strategy "
    "PreferBackward (1F1B) or Interleaved1F1B compile"
)


class CompileBlocks:
    """Model transform: compile the forward of each repeated block this rank runs (a transformer's layers), or of
    the model (its pipeline stages' roots) whole when it has no repeated blocks."""

    name = "compile_blocks"
    phase = TransformPhase.COMPILE

    def __call__(self, model: nn.Module, context: ParallelContext) -> nn.Module:
        """``model``, its chosen forwards compiled in place; the report kept for ``engine.compile_report``."""
        settings = CoreSettings.from_config(context.config).compile
        if context.pipeline.split_backward:
            report = CompileReport(settings.backend, eager={"every block": SPLIT_BACKWARD})
            context.state(CompileState).report = report
            _log.warning("compile: every block stays eager: %s", SPLIT_BACKWARD)
            return model
        blocks = repeated_blocks(model, context.pipeline.stage_modules)
        if not blocks:
            roots = context.pipeline.stage_modules or ("",)
            blocks = [(root, model.get_submodule(root) if root else model) for root in roots]
        changed = without_kv_cache(model)
        if changed:
            _log.info("compile: %s run with use_cache=False (a KV cache recompiles every block)", changed)
        report = compile_blocks(blocks, settings.backend, settings.mode, refuse_random=bool(context.shard_groups))
        context.state(CompileState).report = report
        _log.info("compile: %s", report.describe())
        return model
