"""Options shared by subcommands: a config file and ``--set KEY=VALUE`` overrides."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from epl.config import Config
from epl.errors import ConfigError
from epl.plugins import get_plugin_manager

F = TypeVar("F", bound=Callable[..., Any])


def config_options(command: F) -> F:
    """Add ``--config-file`` and ``--set`` to ``command``."""
    command = click.option(
        "--set",
        "settings",
        multiple=True,
        metavar="KEY=VALUE",
        help="Set a config key, e.g. --set pipeline.num_micro_batch=4 (repeatable).",
    )(command)
    return click.option(
        "--config-file",
        type=click.Path(exists=True, dir_okay=False),
        default=None,
        help="A TOML or JSON file of config keys (also EPL_CONFIG_FILE).",
    )(command)


def parse_settings(settings: tuple[str, ...]) -> dict[str, Any]:
    """``("pipeline.num_micro_batch=4",)`` -> ``{"pipeline.num_micro_batch": 4}``, typed by each key."""
    schema = get_plugin_manager().config_schema()
    parsed: dict[str, Any] = {}
    for setting in settings:
        name, sep, text = setting.partition("=")
        if not sep:
            raise ConfigError(f"--set takes KEY=VALUE, got {setting!r}.")
        key = schema.get(name.strip())
        if key is None:
            parsed[name.strip()] = text  # Config reports the unknown key with a suggestion.
            continue
        try:
            parsed[key.name] = key.parse(text)
        except ValueError as exc:
            raise ConfigError(f"--set {setting}: {exc}. Allowed: {key.allowed()}.") from None
    return parsed


def config_from_options(config_file: str | None, settings: tuple[str, ...]) -> Config:
    """The Config that ``--config-file`` and ``--set`` describe (plus environment variables)."""
    return Config(parse_settings(settings), file=config_file)
