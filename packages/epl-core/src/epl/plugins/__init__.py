"""The process-wide plugin manager, and the ``@epl.hookimpl`` marker."""

from __future__ import annotations

from epl.plugins.manager import (
    CORE_PLUGIN_NAME,
    DISABLE_ENV_VAR,
    ENTRY_POINT_GROUP,
    EplPluginManager,
    PluginInfo,
)
from epl.plugins.marker import hookimpl

_manager: EplPluginManager | None = None


def get_plugin_manager() -> EplPluginManager:
    """The plugin manager of this process, created (and entry points loaded) on first use."""
    global _manager
    if _manager is None:
        _manager = EplPluginManager()
    return _manager


def reset_plugin_manager() -> None:
    """Forget the process-wide plugin manager; the next use discovers plugins again."""
    global _manager
    _manager = None


__all__ = [
    "CORE_PLUGIN_NAME",
    "DISABLE_ENV_VAR",
    "ENTRY_POINT_GROUP",
    "EplPluginManager",
    "PluginInfo",
    "get_plugin_manager",
    "hookimpl",
    "reset_plugin_manager",
]
