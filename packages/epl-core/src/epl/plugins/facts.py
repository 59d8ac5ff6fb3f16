"""The typed facts a configuration's owning plugins derive from it (hook ``epl_config_facts``)."""

from __future__ import annotations

from typing import TypeVar

from epl.config import Config

Fact = TypeVar("Fact")


def config_facts(config: Config, kind: type[Fact]) -> Fact:
    """The record of type ``kind`` (``epl.interfaces.facts``) that its owning plugin built from ``config``, or
    ``kind()``, its defaults, when that plugin is not installed. The records are built once per Config."""
    from epl.plugins import get_plugin_manager

    built = config.derived("facts", lambda: get_plugin_manager().config_facts(config))
    record = built.get(kind)
    return kind() if record is None else record  # type: ignore[return-value]
