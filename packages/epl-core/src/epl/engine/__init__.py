"""The Engine, ``epl.parallelize``/``epl.plan``, and the interfaces plugins extend them through."""

from epl.engine.engine import Engine
from epl.engine.extensions import GradientReducer, ModelTransform, OptimizerWrapper, ParallelContext, StepRunner
from epl.engine.local_runner import LocalStepRunner
from epl.engine.parallelize import parallelize, plan

__all__ = [
    "Engine",
    "GradientReducer",
    "LocalStepRunner",
    "ModelTransform",
    "OptimizerWrapper",
    "ParallelContext",
    "StepRunner",
    "parallelize",
    "plan",
]
