"""EPL, the Easy Parallel Library for PyTorch.

Annotate a local model with :func:`replicate`, :func:`split` and
:func:`set_default_strategy`, call :func:`init` first and :func:`parallelize`
last, and train with ``engine.step(x, y)``.

Names are imported on first use, so that ``import epl`` (and the ``epl``
command, e.g. ``epl launch``) starts without importing PyTorch.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from epl import io, nn
    from epl.cluster import Cluster
    from epl.comm import Communicator, ReduceOp, Work
    from epl.config import Config, ConfigKey
    from epl.engine import Engine, parallelize, plan
    from epl.engine.checkpoint import read_model_state
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
    from epl.strategy.split_rule import ShardContext

#: Public name -> the module it lives in.
_EXPORTS = {
    "io": "epl",
    "nn": "epl",
    "Cluster": "epl.cluster",
    "Communicator": "epl.comm",
    "ReduceOp": "epl.comm",
    "Work": "epl.comm",
    "Config": "epl.config",
    "ConfigKey": "epl.config",
    "Engine": "epl.engine",
    "parallelize": "epl.engine",
    "plan": "epl.engine",
    "read_model_state": "epl.engine.checkpoint",
    "Env": "epl.env",
    "init": "epl.env",
    "AnnotationError": "epl.errors",
    "BatchError": "epl.errors",
    "ClusterError": "epl.errors",
    "ConfigError": "epl.errors",
    "EplError": "epl.errors",
    "MissingPluginError": "epl.errors",
    "NotInitializedError": "epl.errors",
    "PlacementError": "epl.errors",
    "PluginError": "epl.errors",
    "Plan": "epl.placement",
    "hookimpl": "epl.plugins",
    "Strategy": "epl.strategy",
    "TaskGraph": "epl.strategy",
    "replicate": "epl.strategy",
    "set_default_strategy": "epl.strategy",
    "split": "epl.strategy",
    "ShardContext": "epl.strategy.split_rule",
}

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
    "ShardContext",
    "Strategy",
    "TaskGraph",
    "Work",
    "hookimpl",
    "init",
    "io",
    "nn",
    "parallelize",
    "plan",
    "read_model_state",
    "replicate",
    "set_default_strategy",
    "split",
]

try:
    __version__ = version("epl-core")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'epl' has no attribute {name!r}")
    value = (
        importlib.import_module(f"epl.{name}") if module == "epl" else getattr(importlib.import_module(module), name)
    )
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
