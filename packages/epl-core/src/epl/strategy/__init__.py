"""Annotations: strategies, TaskGraphs and their capture."""

from epl.strategy.capture import AnnotationRecorder
from epl.strategy.strategies import Strategy, replicate, set_default_strategy, split
from epl.strategy.taskgraph import TaskGraph

__all__ = ["AnnotationRecorder", "Strategy", "TaskGraph", "replicate", "set_default_strategy", "split"]
