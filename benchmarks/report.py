"""The benchmark report: every result in benchmarks/results/ as one Markdown page with SVG plots.

    python -m benchmarks.report [--results benchmarks/results] [--out docs/benchmarks.md] [--plots DIR] [--note TEXT]

Each benchmark saves a JSON of figures (``benchmarks.harness.save_result``); their keys
differ per benchmark, so every known result has a reader below (:data:`SPECS`) that turns
it into table rows: the feature, what EPL is compared against, the ratio(s) EPL / PyTorch
for time and memory, and the mode, date and machine of the run (the ``"run"`` block the
harness adds). A result written by :func:`benchmarks.harness.compare` that no reader
knows still gets a row; an unreadable or unknown file gets a line saying so. The plots
are SVG written by hand (no plotting dependency): horizontal bars of every ratio on a
log scale, with a line at 1.0. Standard library only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_OUT = ROOT / "docs" / "benchmarks.md"
MIB = 2**20


@dataclass(frozen=True)
class Metric:
    """One ratio EPL / PyTorch; ``label`` says which when a row has several (e.g. "step peak")."""

    label: str
    value: float

    def __post_init__(self) -> None:
        # A reader given a non-number fails here, inside collect()'s error handling, not when writing the page.
        object.__setattr__(self, "value", float(self.value))

    def text(self) -> str:
        """``label value`` with two decimals (three for values under 0.1)."""
        number = f"{self.value:.3f}" if abs(self.value) < 0.1 else f"{self.value:.2f}"
        return f"{self.label} {number}" if self.label else number


@dataclass
class Row:
    """One comparison: a line of the summary table and bars of the plots."""

    feature: str
    against: str
    time: list[Metric] = field(default_factory=list)
    memory: list[Metric] = field(default_factory=list)
    mode: str = "?"
    date: str = "?"
    machine: str = "?"
    source: str = ""
    #: The bars' label in the plots (default: "feature vs against").
    short: str = ""

    def label(self) -> str:
        """The plot label, without Markdown."""
        return (self.short or f"{self.feature} vs {self.against}").replace("`", "")


@dataclass
class Section:
    """What one benchmark measures and what its ratios mean, with the figures of each result file."""

    title: str
    test: str
    meaning: str
    details: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)


#: A reader: (the file's stem, its JSON) -> rows (feature, against, time, memory) and detail lines.
Reader = Callable[[str, dict[str, Any]], tuple[list[Row], list[str]]]


@dataclass(frozen=True)
class Spec:
    """The result files of one benchmark: their names, the test that writes them, how to read them."""

    pattern: str
    test: str
    title: str
    meaning: str
    read: Reader
    expected: tuple[str, ...]
    #: Files of :func:`benchmarks.harness.compare` whose figures this result already holds (no row of their own).
    claims: tuple[str, ...] = ()

    def matches(self, stem: str) -> bool:
        """Whether ``stem`` (a file name without .json) is one of this benchmark's results."""
        return re.fullmatch(self.pattern, stem) is not None


# --------------------------------------------------------------------------- readers


def _ms(value: float) -> str:
    return f"{value:.2f} ms" if value < 10 else f"{value:.1f} ms"


def _mib(value: float) -> str:
    return f"{value / MIB:.2f} MiB"


def _comparison_ms(data: dict[str, Any]) -> tuple[float, float]:
    """(PyTorch, EPL) milliseconds of a harness Comparison."""
    return data["baseline_s"] * 1e3, data["epl_s"] * 1e3


def _comparison_detail(data: dict[str, Any]) -> str:
    torch_ms, epl_ms = _comparison_ms(data)
    rounds, calls = data.get("rounds", "?"), data.get("calls_per_round", "?")
    median = f"median of {rounds} rounds x {calls} calls"
    return f"PyTorch {_ms(torch_ms)}, EPL {_ms(epl_ms)}, ratio {data['ratio']:.3f} ({median})"


def read_local_step(stem: str, data: dict[str, Any]) -> tuple[list[Row], list[str]]:
    micro = int(stem.rsplit("_m", 1)[1])
    feature = f"Local `engine.step`, {micro} micro-batch{'es' if micro > 1 else ''}"
    row = Row(feature, "plain PyTorch loop (same model and optimizer)", time=[Metric("", float(data["ratio"]))])
    row.short = f"local step, {micro} micro-batch{'es' if micro > 1 else ''}, vs plain loop"
    return [row], [f"{micro} micro-batch{'es' if micro > 1 else ''}: {_comparison_detail(data)}"]


def read_launch(stem: str, data: dict[str, Any]) -> tuple[list[Row], list[str]]:
    row = Row("`epl launch` to 2 ranks ready", "`torchrun`", time=[Metric("", float(data["ratio"]))])
    row.short = "epl launch vs torchrun"
    torch_ms, epl_ms = _comparison_ms(data)
    return [row], [
        f"torchrun {torch_ms / 1e3:.2f} s, epl launch {epl_ms / 1e3:.2f} s, ratio {data['ratio']:.3f} "
        f"(median of {data['rounds']} rounds)"
    ]


def read_data_parallel(stem: str, data: dict[str, Any]) -> tuple[list[Row], list[str]]:
    row = Row("Data-parallel step, 2 processes", "`DistributedDataParallel`", time=[Metric("", float(data["ratio"]))])
    row.short = "data parallel vs DDP"
    if "ddp_ms" in data:  # the test's own file; rank 0's Comparison (baseline_s) if the test stopped before it
        details = [f"DDP {_ms(data['ddp_ms'])} per step, EPL {_ms(data['epl_ms'])}, ratio {data['ratio']:.3f}"]
        if "parameters" in data:
            details.append(
                f"{data['parameters']:,} parameters; bytes sent per step EPL {data['epl_bytes_per_step']:,}, "
                f"DDP {data['ddp_bytes_per_step']:,}"
            )
    else:
        details = [_comparison_detail(data)]
    return [row], details


def read_all_reduce(stem: str, data: dict[str, Any]) -> tuple[list[Row], list[str]]:
    rows, details = [], []
    for entry in data["torch_communicator"]:
        size = _bytes_label(entry["bytes"])
        rows.append(
            Row(
                f"`all_reduce`, {size}",
                "`torch.distributed.all_reduce` (gloo)",
                time=[Metric("", entry["ratio"])],
                short=f"all_reduce {size} vs torch.distributed",
            )
        )
        details.append(
            f"{size}: torch.distributed {entry['torch_MBps']:.1f} MB/s, EPL {entry['epl_MBps']:.1f} MB/s, "
            f"time ratio {entry['ratio']:.3f}"
        )
    return rows, details


def _bytes_label(value: int) -> str:
    for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
        if value >= size and value % size == 0:
            return f"{value // size} {unit}"
    return f"{value} B"


def read_amp(stem: str, data: dict[str, Any]) -> tuple[list[Row], list[str]]:
    kept, peaks = data["kept_after_forward_bytes"], data["step_peak_bytes"]
    feature = f"AMP O1, {data['layers']}-layer transformer"
    rows = [
        Row(
            feature,
            "`torch.autocast` + `GradScaler`",
            time=[Metric("", data["time_ratio_vs_torch_amp"])],
            memory=[
                Metric("step peak", data["peak_ratio_vs_torch_amp"]),
                Metric("activations", kept["epl"] / kept["torch_amp"]),
            ],
            short="AMP O1 vs torch.autocast + GradScaler",
        ),
        Row(
            feature,
            "float32 PyTorch (no AMP)",
            time=[Metric("", data["time_ratio_vs_float32"])],
            memory=[
                Metric("step peak", data["peak_ratio_vs_float32"]),
                Metric("activations", data["activation_ratio_vs_float32"]),
            ],
            short="AMP O1 vs float32",
        ),
    ]
    details = [
        f"step time: EPL {_ms(data['epl_ms'])}, torch AMP {_ms(data['torch_amp_ms'])}, "
        f"float32 {_ms(data['float32_ms'])} (batch {data['batch']}, sequence {data['sequence']})",
        f"peak of a step: EPL {_mib(peaks['epl'])}, torch AMP {_mib(peaks['torch_amp'])}, "
        f"float32 {_mib(peaks['float32'])}",
        f"activations kept after forward: EPL {_mib(kept['epl'])}, torch AMP {_mib(kept['torch_amp'])}, "
        f"float32 {_mib(kept['float32'])}",
    ]
    return rows, details


def read_checkpointing(stem: str, data: dict[str, Any]) -> tuple[list[Row], list[str]]:
    kept, peaks = data["kept_after_forward_bytes"], data["step_peak_bytes"]
    feature = f"Gradient checkpointing `auto`, {data['layers']} layers"
    rows = [
        Row(
            feature,
            "no checkpointing",
            time=[Metric("", data["time_ratio_vs_none"])],
            memory=[
                Metric("activations", data["activation_ratio_vs_none"]),
                Metric("step peak", peaks["epl"] / peaks["plain"]),
            ],
            short="checkpointing vs none",
        ),
        Row(
            feature,
            "`torch.utils.checkpoint` by hand",
            time=[Metric("", data["time_ratio_vs_torch"])],
            memory=[
                Metric("activations", data["activation_ratio_vs_torch"]),
                Metric("step peak", peaks["epl"] / peaks["torch"]),
            ],
            short="checkpointing vs torch.utils.checkpoint",
        ),
    ]
    target = data.get("time_target_met")
    details = [
        f"step time: EPL {_ms(data['epl_ms'])}, torch.utils.checkpoint {_ms(data['torch_ms'])}, "
        f"none {_ms(data['plain_ms'])} (batch {data['batch']}, sequence {data['sequence']})"
        + ("" if target is None else f"; time target (<= 1.35 x none) {'met' if target else 'not met'}"),
        f"activations kept after forward: EPL {_mib(kept['epl'])}, torch {_mib(kept['torch'])}, "
        f"none {_mib(kept['plain'])}",
        f"peak of a step: EPL {_mib(peaks['epl'])}, torch {_mib(peaks['torch'])}, none {_mib(peaks['plain'])}",
    ]
    return rows, details


PIPELINE_SCHEDULES = {"gpipe": ("GPipe", "GPipe"), "1f1b": ("1F1B", "1F1B"), "zero_bubble": ("ZeroBubble", "1F1B")}


def read_pipeline(stem: str, data: dict[str, Any]) -> tuple[list[Row], list[str]]:
    rows, details = [], []
    stage_keys = sorted((k for k in data if re.fullmatch(r"\d+_stages", k)), key=lambda k: int(k.split("_")[0]))
    if not stage_keys:
        raise KeyError("no '<N>_stages' entry")
    for key in stage_keys:
        stages = int(key.split("_")[0])
        for name, figures in data[key].items():
            label, torch_schedule = PIPELINE_SCHEDULES.get(name, (name, "?"))
            ours, theirs = figures["epl_peak_saved_bytes"], figures["torch_peak_saved_bytes"]
            worst = max(a / b for a, b in zip(ours, theirs, strict=True) if b)
            rows.append(
                Row(
                    f"Pipeline {label}, {stages} stages",
                    f"torch.distributed.pipelining `Schedule{torch_schedule}`",
                    time=[Metric("", figures["ratio"])],
                    memory=[Metric("saved activations", worst)],
                    short=f"pipeline {label}, {stages} stages, vs {torch_schedule}",
                )
            )
            kib = " / ".join(f"{b / 1024:,.0f}" for b in ours)
            torch_kib = " / ".join(f"{b / 1024:,.0f}" for b in theirs)
            details.append(
                f"{stages} stages, {label}: torch {_ms(figures['torch_ms'])}, EPL {_ms(figures['epl_ms'])} per step, "
                f"ratio {figures['ratio']:.3f}; peak saved activations per stage EPL {kib} KiB, torch {torch_kib} KiB; "
                f"EPL measured bubble {figures.get('epl_measured_bubble', float('nan')):.3f}"
            )
    return rows, details


def read_split_mlp(stem: str, data: dict[str, Any]) -> tuple[list[Row], list[str]]:
    row = Row(
        "Tensor-parallel MLP block (`epl.split`), 2 processes",
        "DTensor `parallelize_module` (Colwise/Rowwise)",
        time=[Metric("", data["ratio"])],
        short="split MLP vs DTensor",
    )
    width, hidden, batch = data.get("width", "?"), data.get("hidden", "?"), data.get("batch", "?")
    detail = (
        f"MLP {width}-{hidden}-{width}, batch {batch}: "
        f"DTensor {_ms(data['torch_ms'])}, EPL {_ms(data['epl_ms'])} per step, ratio {data['ratio']:.3f}"
    )
    if "epl_collectives_per_step" in data:
        detail += (
            f"; collectives per step EPL {data['epl_collectives_per_step']}, "
            f"DTensor {data['torch_collectives_per_step']}"
        )
    return [row], [detail]


def read_split_cross_entropy(stem: str, data: dict[str, Any]) -> tuple[list[Row], list[str]]:
    memory = max(data.get("memory_ratio_per_rank") or [data["memory_ratio"]])
    row = Row(
        "Parallel cross-entropy, 2 processes",
        "all-gathered logits + `F.cross_entropy`",
        time=[Metric("", data["time_ratio"])],
        memory=[Metric("peak", memory)],
        short="parallel cross-entropy vs all-gathered logits",
    )
    details = [
        f"{data.get('rows', '?')} rows x {data.get('classes', '?')} classes: peak allocated EPL "
        f"{_mib(data['epl_peak_bytes'])}, gathered {_mib(data['gathered_peak_bytes'])} "
        f"(logits shard {_mib(data['logits_shard_bytes'])}); time EPL {_ms(data['epl_ms'])}, "
        f"gathered {_ms(data['gathered_ms'])}"
    ]
    return [row], details


ZERO_COUNTERPARTS = {
    "ddp+zero": "DDP + `ZeroRedundancyOptimizer`",
    "fsdp2-grad-op": "FSDP2, no reshard after forward",
    "fsdp2": "FSDP2 `fully_shard`",
}
ZERO_SHORT = {"ddp+zero": "DDP + ZeroRedundancyOptimizer", "fsdp2-grad-op": "FSDP2 no reshard", "fsdp2": "FSDP2"}
ZERO_WHAT = {"v0": "optimizer states", "v1": "states + gradients", "v2": "states + gradients + parameters"}


def read_zero(stem: str, data: dict[str, Any]) -> tuple[list[Row], list[str]]:
    level = stem.split("_")[1]
    ranks = data["ranks"]
    if not ranks:
        raise KeyError("no ranks")
    rows, details = [], []
    for kind in ranks[0]["timing"]:
        held = [(sum(r["held_bytes"]["epl"].values()), sum(r["held_bytes"][kind].values())) for r in ranks]
        peaks = [(r["step_peak_bytes"]["epl"], r["step_peak_bytes"][kind]) for r in ranks]
        rows.append(
            Row(
                f"ZeRO {level} ({ZERO_WHAT.get(level, level)}), 2 processes",
                ZERO_COUNTERPARTS.get(kind, kind),
                time=[Metric("", max(r["timing"][kind]["ratio"] for r in ranks))],
                memory=[
                    Metric("held", max(e for e, _ in held) / max(t for _, t in held)),
                    Metric("step peak", max(e for e, _ in peaks) / max(t for _, t in peaks)),
                ],
                short=f"ZeRO {level} vs {ZERO_SHORT.get(kind, kind)}",
            )
        )
        for r, (ours, theirs), (peak_ours, peak_theirs) in zip(ranks, held, peaks, strict=True):
            timing = r["timing"][kind]
            details.append(
                f"{level} vs {kind}, rank {r.get('rank', '?')}: held EPL {_mib(ours)}, torch {_mib(theirs)}; "
                f"step peak EPL {_mib(peak_ours)}, torch {_mib(peak_theirs)}; "
                f"time EPL {_ms(timing['epl_ms'])}, torch {_ms(timing['torch_ms'])}, ratio {timing['ratio']:.3f}"
            )
    return rows, details


def read_checkpoint(stem: str, data: dict[str, Any]) -> tuple[list[Row], list[str]]:
    rows, details = [], []
    feature = f"Checkpoint {{}}, {data['parameters'] / 1e6:.1f}M-parameter MLP + Adam, 2 processes"
    for what in ("save", "load"):
        per_rank = [float(r) for r in data[f"{what}_ratio_per_rank"]]
        rows.append(
            Row(
                feature.format(what),
                f"`torch.distributed.checkpoint` by hand (`dcp.{what}`)",
                time=[Metric("", max(per_rank))],
                short=f"checkpoint {what} vs dcp.{what}",
            )
        )
        details.append(f"{what}: EPL / dcp per rank " + ", ".join(f"{r:.3f}" for r in per_rank))
    return rows, details


def read_comparison(stem: str, data: dict[str, Any]) -> tuple[list[Row], list[str]]:
    """A :func:`benchmarks.harness.compare` result no other reader knows: its time ratio only."""
    row = Row(f"`{data.get('name', stem)}`", "PyTorch (see the benchmark)", time=[Metric("", float(data["ratio"]))])
    return [row], [f"`{stem}`: {_comparison_detail(data)}"]


def is_comparison(data: object) -> bool:
    """Whether ``data`` has the shape of a harness Comparison."""
    return isinstance(data, dict) and {"baseline_s", "epl_s", "ratio"} <= data.keys()


SPECS: tuple[Spec, ...] = (
    Spec(
        r"local_step_m\d+",
        "benchmarks/test_local_step.py",
        "Local step",
        "Time of EPL's `engine.step` on one process over the plain PyTorch loop (zero_grad, forward, loss, "
        "backward, step; with micro-batches, gradient accumulation) training the engine's own model and "
        "optimizer: a 512-wide 3-layer MLP, batch 64, Adam, one thread. The ratio is EPL's own overhead; "
        "target <= 1.03.",
        read_local_step,
        ("local_step_m1", "local_step_m4"),
    ),
    Spec(
        r"launch_to_ready_vs_torchrun",
        "benchmarks/test_launch.py",
        "Launch",
        "Wall time from the command to 2 ranks joined and through a barrier (`epl.init()` + barrier), "
        "`epl launch` over `torchrun`. Target <= 1.0.",
        read_launch,
        ("launch_to_ready_vs_torchrun",),
    ),
    Spec(
        r"data_parallel_vs_ddp",
        "benchmarks/test_data_parallel.py",
        "Data parallelism",
        "Step time of EPL's data parallelism over `DistributedDataParallel`: the same 9.4M-parameter MLP, "
        "batch 32 per replica, SGD, 2 processes on gloo, rank 0's clock. Both send the same bytes per step. "
        "Target <= 1.00.",
        read_data_parallel,
        ("data_parallel_vs_ddp",),
    ),
    Spec(
        r"all_reduce_bandwidth",
        "benchmarks/test_data_parallel.py",
        "all_reduce by message size",
        "Time of one `all_reduce` through EPL's torch communicator over a bare `torch.distributed.all_reduce` "
        "(both gloo, 2 processes), per message size: the inverse of the bandwidth ratio. Under 64 KiB the "
        "collective is latency-bound and a 2-core machine's scheduling dominates.",
        read_all_reduce,
        ("all_reduce_bandwidth",),
    ),
    Spec(
        r"amp",
        "benchmarks/test_amp.py",
        "AMP O1",
        'EPL with `amp.level = "O1"` (bfloat16 autocast on CPU) on a 4-layer transformer, one thread, over '
        "PyTorch's documented AMP loop (`torch.autocast` + `GradScaler`) and over plain float32. Time: step "
        "time. Memory: *step peak* is the peak a training step allocates (second of two steps), "
        "*activations* the bytes a forward keeps for backward. Against the AMP loop the ratios are EPL's "
        "overhead (target: time <= 1.15, memory <= 1.05); against float32 they are what AMP costs or "
        "saves on this machine (bfloat16 matmuls on a CPU without bf16 units are much slower than float32).",
        read_amp,
        ("amp",),
        claims=("amp_vs_torch_amp", "amp_vs_float32"),
    ),
    Spec(
        r"checkpointing",
        "benchmarks/test_checkpointing.py",
        "Gradient checkpointing",
        'EPL `gradient_checkpoint.type = "auto"` on 12 transformer layers, one thread, over no checkpointing '
        "and over the same layers wrapped by hand in `torch.utils.checkpoint`. Memory: *activations* kept "
        "after a forward (target against none: <= 0.5), *step peak* of a training step. Time: step time; "
        "against none it is the cost of recomputation (issue target 1.35, not met on this 2-core CPU), "
        "against torch EPL's own overhead.",
        read_checkpointing,
        ("checkpointing",),
        claims=("checkpointing_vs_none", "checkpointing_vs_torch"),
    ),
    Spec(
        r"pipeline_vs_torch_pipelining",
        "benchmarks/test_pipeline.py",
        "Pipeline",
        "Step time of EPL's pipeline over `torch.distributed.pipelining` on an 8-layer MLP (width 512) cut into "
        "S stages on S processes, batch 256 in 8 micro-batches, rank 0's clock (4 stages share 2 cores in a "
        "full run). ZeroBubble is compared with torch's `Schedule1F1B` (torch's zero-bubble schedules need "
        "two stages per rank). Memory: the peak activations saved for backward, EPL over torch, on the stage "
        "where that ratio is largest (ZeroBubble keeps more than 1F1B by design). Target: time <= 1.00.",
        read_pipeline,
        ("pipeline_vs_torch_pipelining",),
    ),
    Spec(
        r"split_mlp_vs_dtensor",
        "benchmarks/test_split.py",
        "Tensor parallelism (split)",
        "Step time of a Megatron MLP block (512-2048-512) split over 2 processes by `epl.split(2)`, over the "
        "same block sharded by DTensor's `parallelize_module` with `ColwiseParallel` / `RowwiseParallel`; "
        "the same collectives on both sides (checked). Target <= 1.00.",
        read_split_mlp,
        ("split_mlp_vs_dtensor",),
    ),
    Spec(
        r"split_cross_entropy_vs_gathered",
        "benchmarks/test_split.py",
        "Parallel cross-entropy",
        "EPL's `sharded_cross_entropy` over logits sharded by class on 2 processes, against all-gathering the "
        "logits and calling `F.cross_entropy`: peak bytes allocated by forward + backward (the larger of the "
        "two ranks; about 1/2 expected on 2 devices, asserted < 0.75) and time.",
        read_split_cross_entropy,
        ("split_cross_entropy_vs_gathered",),
    ),
    Spec(
        r"checkpoint",
        "benchmarks/test_checkpoint.py",
        "Checkpoints",
        "Seconds per save and per load of EPL's `engine.save` / `engine.load` (logical, layout-free state through "
        "torch.distributed.checkpoint: whole tensors under the model's names, optimizer states per parameter, "
        "RNG and step, written atomically) over `torch.distributed.checkpoint` used by hand (`dcp.save` / "
        "`dcp.load` of the model's and optimizer's `state_dict`), the same MLP with Adam on 2 processes, local "
        "disk; the larger of the two ranks' ratios. Disk timings on a shared machine are noisy.",
        read_checkpoint,
        ("checkpoint",),
        claims=("checkpoint_save", "checkpoint_load"),
    ),
    Spec(
        r"zero_v\d+_vs_torch",
        "benchmarks/test_zero.py",
        "ZeRO",
        "EPL `zero.level` v0/v1/v2 against PyTorch's counterparts on 2 processes (gloo), the same 1.44M-parameter "
        "MLP with Adam: v0 against DDP + `ZeroRedundancyOptimizer`; v1 against it and against FSDP2 without "
        "reshard; v2 against FSDP2. Time: step time, the larger of the two ranks' ratios. Memory: *held* is "
        "the bytes of parameters, gradients, optimizer states and buffers a rank holds after a step, *step "
        "peak* what a step allocates above that; each is the most-loaded rank of EPL over the most-loaded "
        "rank of torch (what decides whether a model fits).",
        read_zero,
        ("zero_v0_vs_torch", "zero_v1_vs_torch", "zero_v2_vs_torch"),
    ),
)
OTHER = Spec(
    r".*",
    "benchmarks/",
    "Other comparisons",
    "Results of `benchmarks.harness.compare` that this report has no reader for: the time of EPL over its "
    "PyTorch baseline, median of per-round ratios.",
    read_comparison,
    (),
)


# --------------------------------------------------------------------------- collecting


@dataclass
class Report:
    """Everything the page shows, read from one results folder."""

    rows: list[Row] = field(default_factory=list)
    sections: list[Section] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    missing: list[tuple[str, str]] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)
    files: int = 0


def _run_of(path: Path, data: dict[str, Any]) -> tuple[str, str, str, dict[str, Any] | None]:
    """(mode, date, machine label, run block) of a result; saved before the harness recorded them: what is known."""
    run = data.get("run") if isinstance(data.get("run"), dict) else None
    short = run.get("short_mode") if run else data.get("short_mode")
    mode = "?" if short is None else ("short" if short else "full")
    if run and run.get("date"):
        date = _format_date(str(run["date"]))
    else:
        mtime = datetime.datetime.fromtimestamp(path.stat().st_mtime, datetime.UTC)
        date = mtime.strftime("%Y-%m-%d %H:%M") + " (file time)"
    machine = machine_label(run.get("machine")) if run else "?"
    return mode, date, machine, run


def _format_date(value: str) -> str:
    try:
        parsed = datetime.datetime.fromisoformat(value)
    except ValueError:
        return value
    if parsed.tzinfo is not None:
        parsed = parsed.astimezone(datetime.UTC)
    return parsed.strftime("%Y-%m-%d %H:%M")


def machine_label(machine: object) -> str:
    """A short name of the machine: CPU model, cores, GPU if any, torch version."""
    if not isinstance(machine, dict):
        return "?"
    parts = [str(machine.get("cpu") or "unknown CPU")]
    if machine.get("cores"):
        parts[0] += f", {machine['cores']} cores"
    if machine.get("gpu"):
        parts.append(str(machine["gpu"]))
    if machine.get("torch"):
        parts.append(f"torch {machine['torch']}")
    return ", ".join(parts)


def spec_for(stem: str) -> Spec | None:
    """The benchmark whose result ``stem`` is, if any."""
    return next((spec for spec in SPECS if spec.matches(stem)), None)


def collect(results: Path) -> Report:
    """Read every ``*.json`` of ``results``; what cannot be read becomes a line in ``problems``."""
    report = Report()
    paths = sorted(results.glob("*.json")) if results.is_dir() else []
    report.files = len(paths)
    loaded: dict[str, tuple[Path, Any]] = {}
    for path in paths:
        try:
            loaded[path.stem] = (path, json.loads(path.read_text()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            report.problems.append(f"`{path.name}`: not readable as JSON ({type(exc).__name__}: {exc}); skipped.")
    specs = (*SPECS, OTHER)
    sections: dict[Spec, Section] = {}
    rows: list[tuple[int, str, Row]] = []
    # Known results first: the compare() files a result that was read holds get no rows of their own.
    known = {stem: spec for stem in loaded if (spec := spec_for(stem)) is not None}
    claimed: set[str] = set()
    for stem in [*known, *(stem for stem in loaded if stem not in known)]:
        path, data = loaded[stem]
        spec = known.get(stem)
        if spec is None and stem in claimed:
            continue
        if spec is None and is_comparison(data):
            spec = OTHER
        if spec is None:
            keys = ", ".join(sorted(data)[:8]) if isinstance(data, dict) else type(data).__name__
            report.problems.append(
                f"`{path.name}`: not a result this report knows (keys: {keys}); skipped. "
                "Add a reader to `benchmarks/report.py` (SPECS)."
            )
            continue
        if not isinstance(data, dict):
            report.problems.append(f"`{path.name}`: expected a JSON object, found {type(data).__name__}; skipped.")
            continue
        try:
            found, details = spec.read(stem, data)
        except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError, AttributeError) as exc:
            report.problems.append(
                f"`{path.name}`: unexpected content for {spec.test} ({type(exc).__name__}: {exc}); skipped."
            )
            continue
        claimed.update(spec.claims)
        mode, date, machine, run = _run_of(path, data)
        for row in found:
            row.mode, row.date, row.machine, row.source = mode, date, machine, path.name
            rows.append((specs.index(spec), path.name, row))
        if run:
            report.runs.append({**run, "file": path.name})
        section = sections.setdefault(spec, Section(spec.title, spec.test, spec.meaning))
        section.details.extend(details)
        section.sources.append(path.name)
    rows.sort(key=lambda item: item[:2])  # stable: a file's rows keep their order
    report.rows = [row for _, _, row in rows]
    report.sections = [sections[spec] for spec in specs if spec in sections]
    for spec in SPECS:
        report.missing.extend((name, spec.test) for name in spec.expected if name not in loaded)
    return report


# --------------------------------------------------------------------------- SVG


def bar_chart(title: str, bars: Sequence[tuple[str, float]]) -> str:
    """Horizontal bars from 1.0 to each ratio on a log-2 scale, a line at 1.0; an SVG document."""
    bars = [(label, value) for label, value in bars if math.isfinite(value) and value > 0]
    label_width, plot_width, right, bar_height, gap, top = 400, 420, 60, 16, 6, 58
    width = label_width + plot_width + right
    height = top + max(len(bars), 1) * (bar_height + gap) + 40
    values = [value for _, value in bars] or [1.0]
    low = 2 ** min(-1, math.floor(math.log2(min(values))))
    high = 2 ** max(1, math.ceil(math.log2(max(values))))
    span = math.log2(high) - math.log2(low)

    def x(value: float) -> float:
        return label_width + (math.log2(value) - math.log2(low)) / span * plot_width

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        'font-family="Helvetica, Arial, sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="15" font-weight="bold">{escape(title)}</text>',
        f'<text x="{width / 2}" y="38" text-anchor="middle" fill="#555">EPL / PyTorch, log scale: left of 1.0 EPL '
        "is faster or smaller, right of it slower or larger</text>",
    ]
    bottom = height - 30
    exponent = round(math.log2(low))
    while 2**exponent <= high:
        tick = 2.0**exponent
        tx = x(tick)
        colour, stroke = ("#222", 1.5) if exponent == 0 else ("#ddd", 1)
        out.append(
            f'<line x1="{tx:.1f}" y1="{top - 8}" x2="{tx:.1f}" y2="{bottom}" '
            f'stroke="{colour}" stroke-width="{stroke}"/>'
        )
        out.append(f'<text x="{tx:.1f}" y="{bottom + 16}" text-anchor="middle" fill="#333">{tick:g}</text>')
        exponent += 1
    if not bars:
        out.append(f'<text x="{label_width + plot_width / 2}" y="{top + 12}" text-anchor="middle">no data</text>')
    for index, (label, value) in enumerate(bars):
        y = top + index * (bar_height + gap)
        start, end = sorted((x(1.0), x(value)))
        colour = "#2a9d8f" if value <= 1.0 else "#e76f51"
        out.append(
            f'<text x="{label_width - 8}" y="{y + bar_height - 4}" text-anchor="end">{escape(_clip(label, 62))}</text>'
        )
        out.append(
            f'<rect x="{start:.1f}" y="{y}" width="{max(end - start, 1):.1f}" height="{bar_height}" fill="{colour}">'
            f"<title>{escape(label)}: {value:.3f}</title></rect>"
        )
        out.append(f'<text x="{end + 4:.1f}" y="{y + bar_height - 4}" fill="#222">{value:.2f}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _clip(text: str, length: int) -> str:
    return text if len(text) <= length else text[: length - 1] + "…"


def time_bars(rows: Sequence[Row]) -> list[tuple[str, float]]:
    """One bar per time ratio, labelled by its row."""
    return [(row.label(), m.value) for row in rows for m in row.time]


def memory_bars(rows: Sequence[Row]) -> list[tuple[str, float]]:
    """One bar per memory ratio: "row: what"."""
    return [(row.label() + (f": {m.label}" if m.label else ""), m.value) for row in rows for m in row.memory]


# --------------------------------------------------------------------------- Markdown


def _cell(metrics: Sequence[Metric]) -> str:
    return ", ".join(m.text() for m in metrics) if metrics else "—"


def table(rows: Sequence[Row]) -> list[str]:
    """The summary table, one line per comparison."""
    lines = [
        "| Feature | EPL against | Time, EPL / PyTorch | Memory, EPL / PyTorch | Mode | Date (UTC) | Machine |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        cells = [row.feature, row.against, _cell(row.time), _cell(row.memory), row.mode, row.date, row.machine]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return lines


def machines(report: Report) -> list[str]:
    """One bullet per machine the results were measured on, with the load averages seen when they were saved."""
    by_label: dict[str, list[dict[str, Any]]] = {}
    for run in report.runs:
        by_label.setdefault(machine_label(run.get("machine")), []).append(run)
    lines = []
    for label, runs in by_label.items():
        machine = _machine(runs[0])
        facts = [
            f"CPU {machine.get('cpu', '?')}",
            f"{machine.get('cores', '?')} logical cores ({machine.get('usable_cores', '?')} usable)",
        ]
        if machine.get("memory_gib"):
            facts.append(f"{machine['memory_gib']} GiB memory")
        facts.append(f"GPU {machine['gpu']}" if machine.get("gpu") else "no GPU")
        facts += [
            str(machine.get("platform", "?")),
            f"Python {machine.get('python', '?')}",
            f"torch {machine.get('torch', '?')}",
            f"OMP_NUM_THREADS={machine.get('omp_num_threads')}",
        ]
        loads = [load[0] for run in runs if _numbers(load := _machine(run).get("load_average"))]
        dates = sorted(_format_date(str(run["date"])) for run in runs if run.get("date"))
        line = f"- **{label}**: " + "; ".join(facts) + f". {len(runs)} result file(s)"
        if dates:
            line += f", saved {dates[0]} to {dates[-1]} UTC"
        if loads:
            line += (
                f"; 1-minute load average when saved {min(loads):.1f}–{max(loads):.1f} "
                f"(median {statistics.median(loads):.1f})"
            )
            cores = machine.get("usable_cores") or machine.get("cores")
            if isinstance(cores, int) and max(loads) > cores:
                line += (
                    ": above the core count, so the machine was busy with other work while measuring; only "
                    "ratios (both sides timed in alternating rounds under the same load) compare"
                )
        lines.append(line + ".")
    return lines


def _machine(run: dict[str, Any]) -> dict[str, Any]:
    machine = run.get("machine")
    return machine if isinstance(machine, dict) else {}


def _numbers(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, int | float) for v in value)


def markdown(report: Report, plots: dict[str, Path], out: Path, results: Path, notes: Sequence[str] = ()) -> str:
    """The whole page."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M")
    try:
        shown = results.resolve().relative_to(ROOT)
    except ValueError:
        shown = results
    lines = [
        "# Benchmarks: EPL against PyTorch",
        "",
        f"Generated by `python -m benchmarks.report` on {now} UTC from {report.files} file(s) in `{shown}/`. "
        "`nox -s bench` runs every benchmark (`pytest benchmarks`) and then writes this page; "
        "`nox -s bench-short` (CI) runs them in short mode, which keeps them working but does not measure.",
        "",
        "Every benchmark runs EPL and PyTorch's own equivalent in the same job, on the same model and data, "
        "timed in alternating rounds, and reports **EPL / PyTorch**: below 1.0 EPL is faster or holds less "
        "memory, above 1.0 it is slower or holds more. A ratio is the median of the per-round ratios, so the "
        "two sides see the same machine load; absolute times on a shared machine are not comparable between "
        "runs. *Mode* `short` is the CI mode (few rounds, smaller inputs), `?` a result saved before the "
        "harness recorded its run.",
        "",
    ]
    if notes:
        lines += [*(f"> {note}" for note in notes), ""]
    lines += ["## Summary", ""]
    lines += table(report.rows) if report.rows else ["No results: run `nox -s bench` (or `pytest benchmarks -s`)."]
    lines.append("")
    if plots:
        lines += ["## Plots", ""]
        for title, path in plots.items():
            lines += [f"![{title}]({Path(os.path.relpath(path, out.parent)).as_posix()})", ""]
    if report.sections:
        lines += ["## What each ratio means", ""]
        for section in report.sections:
            lines += [f"### {section.title} (`{section.test}`)", "", section.meaning, ""]
            lines += [f"- {detail}" for detail in section.details]
            lines += ["", "Source: " + ", ".join(f"`{name}`" for name in section.sources) + ".", ""]
    if report.runs:
        lines += ["## Machine", "", *machines(report), ""]
    if report.problems or report.missing:
        lines += ["## Not in this report", ""]
        lines += [f"- {problem}" for problem in report.problems]
        lines += [f"- `{name}.json`: no result (run `{test}`)." for name, test in report.missing]
        lines.append("")
    return "\n".join(lines)


def write(results: Path, out: Path, plots_dir: Path | None = None, notes: Sequence[str] = ()) -> Report:
    """Read ``results``; write the SVG plots into ``plots_dir`` (default: ``out`` without .md) and the page."""
    report = collect(results)
    plots_dir = plots_dir if plots_dir is not None else out.parent / out.stem
    plots: dict[str, Path] = {}
    for title, name, bars in (
        ("Time, EPL / PyTorch", "time_ratios.svg", time_bars(report.rows)),
        ("Memory, EPL / PyTorch", "memory_ratios.svg", memory_bars(report.rows)),
    ):
        if bars:
            plots_dir.mkdir(parents=True, exist_ok=True)
            (plots_dir / name).write_text(bar_chart(title, bars))
            plots[title] = plots_dir / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(report, plots, out, results, notes))
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns 0 (a report is written even when some results are missing or unreadable)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="folder of result JSON files")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the Markdown page to write")
    parser.add_argument("--plots", type=Path, default=None, help="folder for the SVG plots (default: OUT without .md)")
    parser.add_argument("--note", action="append", default=[], help="a line to show at the top (repeatable)")
    args = parser.parse_args(argv)
    report = write(args.results, args.out, args.plots, args.note)
    print(
        f"benchmark report: {len(report.rows)} comparison(s) from {report.files} file(s) -> {args.out}"
        + (f"; {len(report.problems)} file(s) skipped" if report.problems else "")
        + (f"; {len(report.missing)} expected result(s) missing" if report.missing else "")
    )
    for problem in report.problems:
        print(f"  {problem}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
