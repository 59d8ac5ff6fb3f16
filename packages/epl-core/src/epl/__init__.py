"""EPL, the Easy Parallel Library for PyTorch.

Annotate a local model with :func:`replicate`, :func:`split` and
:func:`set_default_strategy`, call :func:`init` first and :func:`parallelize`
last, and train with ``engine.step(x, y)``.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from epl import io
from epl.cluster import Cluster
from epl.comm import Communicator, ReduceOp, Work
from epl.config import Config, ConfigKey
from epl.engine import Engine, parallelize, plan
from epl.env import Env, init
from epl.errors import (
    AnnotationError,
    BatchError,
    ClusterError,
    ConfigError,
    EplError,
    MissingPluginError,
    NotInitializedError,
    PlacementError,
    PluginError,
)
from epl.placement import Plan
from epl.plugins import hookimpl
from epl.strategy import Strategy, TaskGraph, replicate, set_default_strategy, split

try:
    __version__ = version("epl-core")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0"

__all__ = [
    "AnnotationError",
    "BatchError",
    "Cluster",
    "ClusterError",
    "Communicator",
    "Config",
    "ConfigError",
    "ConfigKey",
    "Engine",
    "Env",
    "EplError",
    "MissingPluginError",
    "NotInitializedError",
    "PlacementError",
    "Plan",
    "PluginError",
    "ReduceOp",
    "Strategy",
    "TaskGraph",
    "Work",
    "hookimpl",
    "init",
    "io",
    "parallelize",
    "plan",
    "replicate",
    "set_default_strategy",
    "split",
]
