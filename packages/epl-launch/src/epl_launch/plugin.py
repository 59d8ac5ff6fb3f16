"""epl-launch's hook implementation: the ``launch`` subcommand of ``epl``."""

from __future__ import annotations

import click

from epl.plugin_api import hookimpl


@hookimpl
def epl_cli_commands(cli: click.Group) -> None:
    """Add ``epl launch``."""
    from epl_launch.command import launch_command

    cli.add_command(launch_command)
