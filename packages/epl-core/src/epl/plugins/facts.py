"""The typed facts a configuration's owning plugins derive from it (hook ``epl_config_facts``)."""

from __future__ import annotations

from typing import TypeVar

from epl.config import Config
from epl.plugins.context import facts_of

Fact = TypeVar("Fact")


def config_facts(config: Config, kind: type[Fact]) -> Fact:
    """The record of type ``kind`` (``epl.interfaces.facts``) that its owning plugin built from ``config``, or
    ``kind()``, its defaults, when that plugin is not installed. The records are built once per Config."""
    from epl.plugins import get_plugin_manager

    return facts_of(config, kind, get_plugin_manager())
