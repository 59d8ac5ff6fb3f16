"""``epl schedule``: draw a pipeline schedule and print its bubble, for any number of stages."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("schedule")
@click.option("--stages", type=click.IntRange(min=1), required=True, help="Pipeline stages.")
@click.option("--micro-batches", type=click.IntRange(min=1), required=True, help="Micro-batches per step.")
@click.option(
    "--strategy", default="PreferBackward", show_default=True, help="A registered schedule (pipeline.strategy)."
)
@click.option("--backward-cost", type=float, default=2.0, show_default=True, help="Cost of a backward, forward = 1.")
@click.option("--trace", type=click.Path(dir_okay=False, path_type=Path), help="Write a Chrome trace (Perfetto).")
@click.option("--png", "png_path", type=click.Path(dir_okay=False, path_type=Path), help="Write a PNG drawing.")
def schedule_command(
    stages: int, micro_batches: int, strategy: str, backward_cost: float, trace: Path | None, png_path: Path | None
) -> None:
    """Show the timeline of a pipeline schedule and its bubble fraction (simulated, no processes)."""
    from epl.plugin_api import get_plugin_manager
    from epl_pipeline import drawing
    from epl_pipeline.schedules import bubble, build, timeline

    try:
        schedule = build(strategy, get_plugin_manager().pipeline_schedules(), stages, micro_batches)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--strategy") from None
    events = timeline(schedule, 1.0, backward_cost)
    makespan, idle = bubble(events, stages)
    click.echo(drawing.text(events, stages))
    click.echo(
        f"{strategy}: {stages} stages x {micro_batches} micro-batches, makespan {makespan:g}, "
        f"bubble {idle:.3f} (GPipe/1F1B theory (S-1)/(M+S-1) = "
        f"{(stages - 1) / (micro_batches + stages - 1):.3f})"
    )
    if trace is not None:
        trace.write_text(drawing.chrome_trace(events))
        click.echo(f"trace: {trace}")
    if png_path is not None:
        drawing.png(events, stages, png_path)
        click.echo(f"png: {png_path}")
