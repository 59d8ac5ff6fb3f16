"""``epl calibrate``: this machine's GEMM throughput and collective bandwidth as a device profile for ``epl plan``."""

from __future__ import annotations

import json

import click

from epl.errors import EplError


@click.command("calibrate")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default="fp32", help="GEMM dtype [fp32].")
@click.option(
    "--base",
    metavar="NAME",
    default=None,
    help="The device this machine has (h100-sxm, ...): keep its datasheet "
    "peak and set the efficiency to the measured fraction of it.",
)
@click.option("--seconds", type=click.FloatRange(min=0.1), default=1.0, help="Seconds of GEMMs to time [1].")
@click.option("--size", type=click.IntRange(min=64), default=2048, help="Matrix size of the GEMMs [2048].")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="Write the profile here (JSON).")
def calibrate_command(dtype: str, base: str | None, seconds: float, size: int, out: str | None) -> None:
    """Measure this machine's GEMM FLOP/s and all-reduce bandwidth (two local processes) and print, or write to
    --out, a device profile that `epl plan --device FILE` reads (docs/planner.md)."""
    from epl.planner.calibrate import calibrate  # imports PyTorch: only when calibrating

    try:
        profile = calibrate(dtype=dtype, base=base, seconds=seconds, size=size)
    except EplError as exc:
        raise click.ClickException(str(exc)) from exc
    text = json.dumps(profile.to_dict(), indent=2)
    if out is None:
        click.echo(text)
        return
    with open(out, "w") as handle:
        handle.write(text + "\n")
    flops = profile.peak(dtype) * profile.efficiency
    click.echo(f"{out}: {flops / 1e12:.3f} TFLOP/s {dtype}, all-reduce {profile.intra_node_bandwidth / 1e9:.2f} GB/s")
