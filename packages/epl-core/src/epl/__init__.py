"""EPL, the Easy Parallel Library for PyTorch.

Annotate a local model with :func:`replicate`, :func:`split` and
:func:`set_default_strategy`, call :func:`init` first and :func:`parallelize`
last, and train with ``engine.step(x, y)``.

Names are imported on first use, so that ``import epl`` (and the ``epl``
command, e.g. ``epl launch``) starts without importing PyTorch. This module is
the top of epl-core's layers (see docs/architecture.md); plugins import from
:mod:`epl.plugin_api` instead.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from epl.lazy import lazy_exports

if TYPE_CHECKING:
    from epl import io, nn
    from epl.annotations import Strategy, TaskGraph, replicate, set_default_strategy, split
    from epl.compiling import CompileReport
    from epl.config import Config
    from epl.errors import (
        AnnotationError,
        BatchError,
        BatchMismatchError,
        ClusterError,
        ConfigError,
        EplError,
        MissingPluginError,
        NotInitializedError,
        PlacementError,
        PluginError,
        UninitializedError,
        VocabularyError,
    )
    from epl.interfaces.cluster import Cluster
    from epl.interfaces.communicator import Communicator, ReduceOp, Work
    from epl.interfaces.config_key import ConfigKey
    from epl.interfaces.split_rule import ShardContext
    from epl.placement import Plan
    from epl.plugins import hookimpl
    from epl.progress import Progress
    from epl.runtime import Engine, parallelize, plan
    from epl.runtime.checkpoint import CheckpointSave, read_model_state
    from epl.runtime.env import Env, init

#: Public name -> the module it lives in.
_EXPORTS = {
    "io": "epl",
    "nn": "epl",
    "Cluster": "epl.interfaces.cluster",
    "Communicator": "epl.interfaces.communicator",
    "ReduceOp": "epl.interfaces.communicator",
    "Work": "epl.interfaces.communicator",
    "Config": "epl.config",
    "ConfigKey": "epl.interfaces.config_key",
    "Engine": "epl.runtime",
    "parallelize": "epl.runtime",
    "plan": "epl.runtime",
    "read_model_state": "epl.runtime.checkpoint",
    "CheckpointSave": "epl.runtime.checkpoint",
    "CompileReport": "epl.compiling",
    "Env": "epl.runtime.env",
    "init": "epl.runtime.env",
    "AnnotationError": "epl.errors",
    "BatchError": "epl.errors",
    "BatchMismatchError": "epl.errors",
    "UninitializedError": "epl.errors",
    "VocabularyError": "epl.errors",
    "ClusterError": "epl.errors",
    "ConfigError": "epl.errors",
    "EplError": "epl.errors",
    "MissingPluginError": "epl.errors",
    "NotInitializedError": "epl.errors",
    "PlacementError": "epl.errors",
    "PluginError": "epl.errors",
    "Plan": "epl.placement",
    "Progress": "epl.progress",
    "hookimpl": "epl.plugins",
    "Strategy": "epl.annotations",
    "TaskGraph": "epl.annotations",
    "replicate": "epl.annotations",
    "set_default_strategy": "epl.annotations",
    "split": "epl.annotations",
    "ShardContext": "epl.interfaces.split_rule",
}

__all__ = [
    "AnnotationError",
    "BatchError",
    "BatchMismatchError",
    "UninitializedError",
    "VocabularyError",
    "CheckpointSave",
    "Cluster",
    "ClusterError",
    "Communicator",
    "CompileReport",
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
    "Progress",
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

# The plugin layer (pluggy, no PyTorch) makes the process's plugin manager the key source of epl.Config.
import epl.plugins  # noqa: E402, F401

try:
    __version__ = version("epl-core")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0"


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
