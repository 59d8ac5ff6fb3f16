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
    from epl.plugins import get_plugin_manager
    from epl_pipeline import drawing
    from epl_pipeline.schedules import check, timeline

    schedules = get_plugin_manager().pipeline_schedules()
    if strategy not in schedules:
        raise click.BadParameter(
            f"{strategy!r}; registered schedules: {', '.join(sorted(schedules))}", param_hint="--strategy"
        )
    schedule = schedules[strategy](stages, micro_batches)
    check(schedule, stages, micro_batches)
    events = timeline(schedule, 1.0, backward_cost)
    makespan = max(e.end for e in events)
    busy = sum(e.end - e.start for e in events)
    click.echo(drawing.text(events, stages))
    click.echo(
        f"{strategy}: {stages} stages x {micro_batches} micro-batches, makespan {makespan:g}, "
        f"bubble {1 - busy / (stages * makespan):.3f} (GPipe/1F1B theory (S-1)/(M+S-1) = "
        f"{(stages - 1) / (micro_batches + stages - 1):.3f})"
    )
    if trace is not None:
        trace.write_text(drawing.chrome_trace(events))
        click.echo(f"trace: {trace}")
    if png_path is not None:
        drawing.png(events, stages, png_path)
        click.echo(f"png: {png_path}")
