"""Plugins: the hook specs, the ``@epl.hookimpl`` marker, and the process-wide plugin manager.

Importing this package makes the process's plugin manager the key source of ``epl.Config``
(``epl.config.use_default_key_source``); ``import epl`` imports it.
"""

from __future__ import annotations

from epl.config import use_default_key_source
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


use_default_key_source(get_plugin_manager)


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
