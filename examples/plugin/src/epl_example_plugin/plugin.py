"""epl-example-plugin's hooks: the module its entry point names.

Each hook imports what it hands to EPL only when it is called, so that loading the plugin
(which every ``epl`` command does) costs nothing, PyTorch included.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from epl.plugin_api import hookimpl

if TYPE_CHECKING:
    from collections.abc import Sequence

    import click

    from epl.plugin_api import ConfigKey, ModelTransform, ParallelContext, ScheduleGenerator


@hookimpl
def epl_config_keys() -> Sequence[ConfigKey]:
    """``example.check_finite``; EPL records this plugin (``epl-example-plugin``) as its ``provided_by``."""
    from epl_example_plugin.keys import KEYS

    return KEYS


@hookimpl
def epl_pipeline_schedules() -> dict[str, ScheduleGenerator]:
    """``InOrderBackward``: every forward, then the backwards oldest first."""
    from epl_example_plugin.schedules import SCHEDULES

    return dict(SCHEDULES)


@hookimpl
def epl_cli_commands(cli: click.Group) -> None:
    """Add ``epl example-info``."""
    from epl_example_plugin.command import example_info_command

    cli.add_command(example_info_command)


@hookimpl
def epl_model_transforms(context: ParallelContext) -> list[ModelTransform] | None:
    """``CheckFinite`` when ``example.check_finite`` is set; otherwise nothing."""
    from epl_example_plugin.settings import ExamplePluginSettings

    if not ExamplePluginSettings.from_config(context.config).example.check_finite:
        return None
    from epl_example_plugin.transforms import CheckFinite

    return [CheckFinite()]
