"""Annotations: strategies, TaskGraphs and their capture."""

from epl.annotations.capture import AnnotationRecorder
from epl.annotations.strategies import Strategy, replicate, set_default_strategy, split
from epl.annotations.taskgraph import TaskGraph

__all__ = ["AnnotationRecorder", "Strategy", "TaskGraph", "replicate", "set_default_strategy", "split"]
