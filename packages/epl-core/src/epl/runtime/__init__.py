"""The runtime: ``epl.init`` and ``Env``, ``epl.parallelize``/``epl.plan``, the Engine, checkpoints, plan-only runs."""

from epl.plugins.context import GradientReducer, ModelTransform, OptimizerWrapper, ParallelContext, StepRunner
from epl.runtime.engine import Engine
from epl.runtime.parallelize import parallelize, plan

__all__ = [
    "Engine",
    "GradientReducer",
    "ModelTransform",
    "OptimizerWrapper",
    "ParallelContext",
    "StepRunner",
    "parallelize",
    "plan",
]
