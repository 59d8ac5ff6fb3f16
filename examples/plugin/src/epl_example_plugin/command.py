"""``epl example-info``: this plugin's config key with its value, and its schedules drawn as text."""

from __future__ import annotations

import click


@click.command("example-info")
@click.option("--stages", type=click.IntRange(min=1), default=2, show_default=True, help="Pipeline stages to show.")
@click.option(
    "--micro-batches", type=click.IntRange(min=1), default=4, show_default=True, help="Micro-batches to show."
)
def example_info_command(stages: int, micro_batches: int) -> None:
    """Show epl-example-plugin's config key (value and where it came from) and the schedules it registers."""
    from epl.plugin_api import Config, ConfigError, get_plugin_manager
    from epl_example_plugin import DISTRIBUTION
    from epl_example_plugin.keys import KEYS
    from epl_example_plugin.schedules import SCHEDULES

    try:
        config = Config()  # the environment (EPL_EXAMPLE_CHECK_FINITE) and EPL_CONFIG_FILE
    except ConfigError as error:
        raise click.ClickException(str(error)) from None
    manager = get_plugin_manager()
    click.echo(f"{DISTRIBUTION}: config keys")
    for key in KEYS:
        click.echo(f"  {key.name} = {config[key.name]!r} ({config.source(key.name)}; env {key.env_var})")
    registered = manager.pipeline_schedules()
    runs = "runs with epl-pipeline" if manager.has_plugin("epl-pipeline") else "needs epl-pipeline to run"
    click.echo(f"{DISTRIBUTION}: pipeline schedules ({runs}; set pipeline.strategy to the name)")
    for name, generator in SCHEDULES.items():
        status = "registered" if registered.get(name) is generator else "NOT registered"
        click.echo(f"  {name} ({status}), {stages} stages x {micro_batches} micro-batches:")
        for stage, actions in enumerate(generator(stages, micro_batches)):
            click.echo(f"    stage {stage}: " + " ".join("." if a is None else str(a) for a in actions))
