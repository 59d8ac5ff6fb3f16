"""``epl plan``: the Plan of a training script or a manual example on any number of devices."""

from __future__ import annotations

import click

from epl import examples
from epl.cli.options import parse_settings
from epl.errors import EplError


@click.command(
    "plan",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.option(
    "--world-size", "-n", type=click.IntRange(min=1), required=True, help="Devices (processes) in the cluster."
)
@click.option(
    "--gpu-per-worker", type=click.IntRange(min=1), default=None, help="Devices per node [default: all on one node]."
)
@click.option(
    "--example",
    type=click.Choice(examples.names()),
    default=None,
    help="Plan one of the manual's examples instead of a script.",
)
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE", help="Override a config key (repeatable).")
@click.option(
    "--optimizer",
    metavar="NAME",
    default=None,
    help="Estimate optimizer states for this torch.optim class (Adam, SGD, ...) instead of the script's "
    "optimizer [default: the script's; none for --example].",
)
@click.option(
    "--device",
    metavar="NAME|FILE",
    default=None,
    help="Estimate activations, step time and MFU on this device: a100-40gb, a100-80gb, h100-sxm, h100-pcie, h200, "
    "b200, l40s, or a JSON profile (epl calibrate writes one).",
)
@click.option("--global-batch-size", type=click.IntRange(min=1), default=None, help="Sequences per step.")
@click.option("--sequence-length", type=click.IntRange(min=1), default=None, help="Tokens per sequence.")
@click.option(
    "--dtype",
    type=click.Choice(["bf16", "fp16", "fp32"]),
    default=None,
    help="Compute dtype [bf16; with the script's amp.level, bf16 autocast over float32 weights].",
)
@click.option(
    "--auto",
    "auto",
    is_flag=True,
    help="Search data, tensor and pipeline degrees, micro-batches, ZeRO, "
    "checkpointing and schedules for the fastest plan that fits (with --device).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the Plan (or the estimates) as JSON.")
@click.argument("script", required=False, type=click.Path(exists=True, dir_okay=False))
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def plan_command(
    world_size: int,
    gpu_per_worker: int | None,
    example: str | None,
    settings: tuple[str, ...],
    optimizer: str | None,
    device: str | None,
    global_batch_size: int | None,
    sequence_length: int | None,
    dtype: str | None,
    auto: bool,
    as_json: bool,
    script: str | None,
    script_args: tuple[str, ...],
) -> None:
    """Show how SCRIPT (run up to epl.parallelize) or --example would be placed on WORLD_SIZE devices.

    Nothing trains and no processes start: the script runs in this process with a
    virtual cluster, and stops at epl.parallelize. Arguments after SCRIPT are
    passed to it. Example: epl plan --world-size 1024 train.py --lr 3e-4

    For each split TaskGraph, what each device of a replica holds, by the split
    rules (layer numbers shown as *); what the run would refuse to split (a module
    no rule covers, sizes that do not divide) fails with the run's message.

    Under the Plan, the memory each device would hold: parameters, gradients and
    optimizer states, estimated (with ZeRO and other plugins' adjustments).

    With --device, --global-batch-size and --sequence-length (a transformers model):
    activations, peak memory, the step time and its parts, tokens/s and MFU of the
    script's layout; with --auto, the fastest layout that fits, what to paste, and
    the runners-up (docs/planner.md).
    """
    if (script is None) == (example is None):
        raise click.UsageError("Give a SCRIPT or --example NAME (one of them).")
    if (device is not None or auto) and (device is None or global_batch_size is None or sequence_length is None):
        raise click.UsageError("Estimates need --device, --global-batch-size and --sequence-length together.")
    from epl.placement.request import PlanRequest  # imports PyTorch: only when planning
    from epl.runtime.planning import planned_model, planned_script

    try:
        request = PlanRequest(
            world_size=world_size,
            gpu_per_worker=gpu_per_worker,
            overrides=parse_settings(settings),
            optimizer=optimizer,
        )
        if script:
            ready = planned_script(script, script_args, request)
        else:
            chosen = examples.get(example or "")
            ready = planned_model(chosen.config, chosen.build, request)
        plan = ready.plan
        if device is None:
            click.echo(plan.to_json() if as_json else str(plan))
            return
        from epl.cli.plan_estimates import show_estimates

        assert global_batch_size is not None and sequence_length is not None
        click.echo(show_estimates(ready, device, global_batch_size, sequence_length, dtype, auto, as_json))
    except EplError as exc:
        raise click.ClickException(str(exc)) from exc
