"""``epl config``: every config key with its type, default, allowed values and package."""

from __future__ import annotations

import json

import click

from epl.cli.options import config_from_options, config_options
from epl.config import Config, ConfigKey
from epl.errors import EplError


@click.command("config")
@click.option(
    "--format",
    "output_format",
    type=click.Choice(["table", "json", "markdown"]),
    default="table",
    show_default=True,
    help="Output format.",
)
@config_options
def config_command(output_format: str, config_file: str | None, settings: tuple[str, ...]) -> None:
    """Show every config key, its default and its current value.

    Values come from the defaults, --config-file, EPL_<SECTION>_<KEY> environment
    variables and --set, in increasing precedence.
    """
    try:
        config = config_from_options(config_file, settings)
    except EplError as exc:
        raise click.ClickException(str(exc)) from exc
    if output_format == "json":
        click.echo(json.dumps(_as_json(config), indent=2))
    elif output_format == "markdown":
        click.echo(render_markdown(config))
    else:
        click.echo(render_table(config))


def render_table(config: Config) -> str:
    """Keys grouped by section, each with its value, source, default, allowed values, package and doc."""
    lines: list[str] = []
    section = None
    for name, key in config.keys().items():
        if key.section != section:
            section = key.section
            if lines:
                lines.append("")
            lines.append(f"[{section}]")
        value = config[name]
        source = config.source(name)
        shown = f"{value!r}" + ("" if source == "default" else f"  (from {source})")
        lines.append(f"  {name} = {shown}")
        lines.append(
            f"      type {key.type_name()}, default {key.default!r}, allowed: {key.allowed()}; "
            f"env {key.env_var}; package {_package(key)}"
        )
        lines.append(f"      {key.doc}")
    lines += _absent_packages()
    return "\n".join(lines)


def _absent_packages() -> list[str]:
    """A line per package of :data:`epl.config.KEY_OWNERS` that is not installed: its keys are not listed."""
    from epl.config import KEY_OWNERS
    from epl.plugins import get_plugin_manager

    manager = get_plugin_manager()
    absent: dict[str, list[str]] = {}
    for prefix, package in KEY_OWNERS.items():
        if not manager.has_plugin(package):
            absent.setdefault(package, []).append(prefix + "*" if prefix.endswith(".") else prefix)
    lines = []
    for package, prefixes in absent.items():
        blocked = package in manager.blocked
        state, fix = (
            ("blocked", "unblock it in EPL_DISABLE_EXTERNAL_PLUGINS")
            if blocked
            else ("not installed", f"pip install {package}")
        )
        lines.append(f"\n({package} is {state}: its keys {', '.join(prefixes)} are not listed; {fix})")
    return lines


def render_markdown(config: Config) -> str:
    """The keys as a Markdown table (docs/config.md is generated from it)."""
    rows = [
        "| Key | Type | Default | Allowed | Package | Description |",
        "|---|---|---|---|---|---|",
    ]
    for name, key in config.keys().items():
        rows.append(
            f"| `{name}` | {key.type_name()} | `{key.default!r}` | {key.allowed()} | {_package(key)} | {key.doc} |"
        )
    return "\n".join(rows)


def _package(key: ConfigKey) -> str:
    return key.provided_by or "epl-core"


def _as_json(config: Config) -> list[dict[str, object]]:
    return [
        {
            "key": name,
            "value": config[name],
            "source": config.source(name),
            "type": key.type_name(),
            "default": key.default,
            "allowed": key.allowed(),
            "package": _package(key),
            "env": key.env_var,
            "doc": key.doc,
        }
        for name, key in config.keys().items()
    ]
