"""``epl plugins``: the installed plugins and the hooks each implements."""

from __future__ import annotations

import click

from epl.plugins import DISABLE_ENV_VAR, get_plugin_manager


@click.command("plugins")
def plugins_command() -> None:
    """List the registered plugins, where each comes from and the hooks it implements."""
    manager = get_plugin_manager()
    for info in manager.plugins():
        click.echo(f"{info.name}  ({info.source})")
        click.echo(f"    hooks: {', '.join(info.hooks) or '-'}")
    if manager.blocked:
        click.echo(f"blocked by {DISABLE_ENV_VAR}: {', '.join(manager.blocked)}")
