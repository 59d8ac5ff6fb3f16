"""``epl schedule``: draw a pipeline schedule and print its bubble, for any number of stages."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("schedule")
@click.option("--stages", type=click.IntRange(min=1), required=True, help="Pipeline stages (S).")
@click.option("--micro-batches", type=click.IntRange(min=1), required=True, help="Micro-batches per step.")
@click.option(
    "--strategy", default="PreferBackward", show_default=True, help="A registered schedule (pipeline.strategy)."
)
@click.option(
    "--stages-per-rank",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Stages each pipeline rank runs (pipeline.stages_per_rank, v): S / v ranks, e.g. with Interleaved1F1B.",
)
@click.option("--backward-cost", type=float, default=2.0, show_default=True, help="Cost of a backward, forward = 1.")
@click.option("--trace", type=click.Path(dir_okay=False, path_type=Path), help="Write a Chrome trace (Perfetto).")
@click.option(
    "--picture",
    "--png",
    "picture",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write a picture (matplotlib: the plot extra) in the format its suffix names: .png, .svg, .pdf, ...",
)
def schedule_command(
    stages: int,
    micro_batches: int,
    strategy: str,
    stages_per_rank: int,
    backward_cost: float,
    trace: Path | None,
    picture: Path | None,
) -> None:
    """Show the timeline of a pipeline schedule and its bubble fraction (simulated, no processes).

    Costs are per rank's share of the model: with several stages per rank each stage's action costs 1/v of them.
    """
    from epl.plugin_api import EplError, get_plugin_manager
    from epl_pipeline import drawing, plot
    from epl_pipeline.schedules import bubble, build, timeline

    if picture is not None:
        try:
            plot.picture_format(picture)
        except EplError as error:
            raise click.BadParameter(str(error), param_hint="--picture") from None

    registered = get_plugin_manager().pipeline_schedules()
    try:
        schedule = build(strategy, registered, stages, micro_batches, stages_per_rank)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--strategy") from None
    lanes = len(schedule)
    events = timeline(schedule, 1.0, backward_cost)
    makespan, idle = bubble(events, lanes)
    click.echo(drawing.text(events, lanes))
    click.echo(_summary(strategy, stages, lanes, micro_batches, makespan, idle))
    if trace is not None:
        trace.write_text(drawing.chrome_trace(events, lanes))
        click.echo(f"trace: {trace}")
    if picture is not None:
        plot.write_picture(events, lanes, picture, f"{strategy} schedule (planned)")
        click.echo(f"picture: {picture}")


def _summary(strategy: str, stages: int, lanes: int, micro: int, makespan: float, idle: float) -> str:
    """The simulated makespan and bubble, beside the theory of GPipe/1F1B (or, with several stages per rank,
    of interleaved 1F1B, which the simulator matches exactly)."""
    per_rank = stages // lanes
    if per_rank == 1:
        size = f"{stages} stages x {micro} micro-batches"
        theory = f"GPipe/1F1B theory (S-1)/(M+S-1) = {(stages - 1) / (micro + stages - 1):.3f}"
    else:
        size = f"{stages} stages on {lanes} pipeline ranks ({per_rank} per rank) x {micro} micro-batches"
        theory = f"interleaved 1F1B theory (P-1)/(v*M+P-1) = {(lanes - 1) / (per_rank * micro + lanes - 1):.3f}"
    return f"{strategy}: {size}, makespan {makespan:g}, bubble {idle:.3f} ({theory})"
