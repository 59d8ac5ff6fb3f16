"""The ``epl`` command: a click group that plugins add subcommands to."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import click

from epl.errors import EplError
from epl.plugins import EplPluginManager, get_plugin_manager

#: Subcommands of EPL's own packages: when one is missing, the error says which package to install.
COMMAND_PACKAGES = {"launch": "epl-launch", "schedule": "epl-pipeline"}


class EplGroup(click.Group):
    """The ``epl`` group: an unknown subcommand that an EPL package provides names that package."""

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        """The subcommand ``args`` names; one of a missing EPL package fails with that package's name."""
        name = args[0] if args else None
        package = COMMAND_PACKAGES.get(name or "")
        if package is not None and self.get_command(ctx, name or "") is None:
            ctx.fail(
                f"epl {name} is provided by the package {package}, which is not installed: pip install {package} "
                f"(from a checkout: pip install -e packages/{package})."
            )
        return super().resolve_command(ctx, args)


def make_cli(plugins: EplPluginManager | None = None) -> click.Group:
    """The ``epl`` group with the subcommands of every installed plugin (the core's included)."""

    @click.group(cls=EplGroup, context_settings={"help_option_names": ["-h", "--help"]})
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
