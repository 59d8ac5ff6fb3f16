"""The ``epl`` command: a click group that plugins add subcommands to."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import click

from epl.errors import EplError
from epl.plugins import EplPluginManager, get_plugin_manager


def make_cli(plugins: EplPluginManager | None = None) -> click.Group:
    """The ``epl`` group with the subcommands of every installed plugin (the core's included)."""

    @click.group(context_settings={"help_option_names": ["-h", "--help"]})
    @click.version_option(package_name="epl-core", prog_name="epl")
    def cli() -> None:
        """EPL, the Easy Parallel Library for PyTorch."""

    (plugins or get_plugin_manager()).add_cli_commands(cli)
    return cli


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``epl`` console script."""
    try:
        cli = make_cli()
    except EplError as exc:
        click.echo(f"epl: {exc}", err=True)
        sys.exit(2)
    cli.main(args=list(argv) if argv is not None else None, prog_name="epl")
