"""The planner's predicted peak memory per rank against the measured one, for every layout the zoo runs.

**The model.** transformers' ``LlamaForCausalLM``, float32, SDPA, untied: hidden 768, 12 layers, 12 attention heads
over 4 key/value heads, SwiGLU MLP of 2048, vocabulary 32000 (:data:`MODEL`: 123M parameters), trained with Adam
on its own loss (``labels``), built on the meta device (``model.meta_init``: each rank makes only what it keeps).
Adam runs ``foreach=True``, as torch runs it by default on GPUs (on a CPU it defaults to one tensor at a time, whose
step holds two temporaries of the largest tensor instead of one of everything it updates).
Each replica trains on :data:`ROWS` sequences of :data:`SEQUENCE` tokens a step (a pipeline on
:data:`PIPELINE_ROWS`, in 4 micro-batches).

**Measured per rank**: the growth of the process's resident set (``VmHWM``, :mod:`benchmarks.resident`) from
before the model is built to its peak over :data:`STEPS` steps, less the same run's growth with a tiny model of the
same layout (:data:`TINY`: what the process adds by itself, its first collectives, threads and libraries). glibc
gives freed blocks back at once in these processes (:func:`benchmarks.resident.allocation_tracking_children`), so
that resident memory follows what they allocate.

**Predicted**: :func:`epl.planner.memory.stage_breakdown` for the rank's pipeline stage, the layout read from the
run's own Plan and config (:func:`epl.planner.from_plan.layout_of`).

``nox -s planner-memory`` runs every layout of :data:`LAYOUTS` (``python -m benchmarks.planner_memory [NAME ...]``),
writes benchmarks/results/planner_memory.json and prints the table of docs/planner.md ("Measured here"). CI runs a
slice of it on a smaller model (tests/planner/test_measured_memory.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.helpers.distributed import run_ranks

from benchmarks.harness import RESULTS, machine_info
from benchmarks.resident import allocation_tracking_children

GIB = 2**30
#: The measured model: transformers' LlamaConfig's arguments (about 100M parameters: 123M, 75M of them in blocks).
MODEL = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 4,
         "intermediate_size": 2048, "vocab_size": 32000}  # fmt: skip
#: The process's own growth is measured with this model, under the same layout (4 layers: 2 x 2 interleaved chunks).
TINY = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "vocab_size": 256}  # fmt: skip
#: Sequences of each replica's batch, and their tokens (a multiple of 4: context 2 cuts each into 4 chunks).
ROWS, SEQUENCE = 4, 256
#: Sequences of a pipeline's batch: 4 micro-batches of 2.
PIPELINE_ROWS = 8
#: Adam steps measured (the first makes Adam's states; the peak is in the second, as in the third: measured).
STEPS = 2
#: The relative error the planner's peak must stay within (issue 43).
TOLERANCE = 0.15

PIPELINE = {"auto.auto_parallel": True, "pipeline.num_stages": 2, "pipeline.num_micro_batch": 4}
#: AMP O1 in bf16 (on a CPU, torch.autocast("cpu") in bfloat16).
AMP = {"amp.level": "O1", "amp.dtype": "bfloat16"}
#: 2 ranks of 2 chunks each (4 stages), Megatron's interleaved 1F1B.
INTERLEAVED = {
    **PIPELINE,
    "pipeline.num_stages": 4,
    "pipeline.stages_per_rank": 2,
    "pipeline.strategy": "Interleaved1F1B",
}


@dataclass(frozen=True)
class MeasuredLayout:
    """One layout: ``world`` processes, ``config`` (EPL's keys), the model built inside ``epl.split(split)``,
    ``rows`` sequences a replica."""

    world: int
    config: Mapping[str, Any] = field(default_factory=dict)
    split: int = 1
    rows: int = ROWS


#: Every layout the zoo runs (tests/zoo/conformance.py), each schedule, ZeRO's levels and sequence parallelism.
LAYOUTS: dict[str, MeasuredLayout] = {
    "data parallel 2": MeasuredLayout(2),
    "ZeRO v0 x 2": MeasuredLayout(2, {"zero.level": "v0"}),
    "ZeRO v1 x 2": MeasuredLayout(2, {"zero.level": "v1"}),
    "ZeRO v2 x 2": MeasuredLayout(2, {"zero.level": "v2"}),
    "split(2)": MeasuredLayout(2, split=2),
    "split(2), sequence parallel": MeasuredLayout(2, {"split.sequence_parallel": True}, split=2),
    "2 stages, 1F1B": MeasuredLayout(2, {**PIPELINE, "pipeline.strategy": "PreferBackward"}, rows=PIPELINE_ROWS),
    "2 stages, GPipe": MeasuredLayout(2, {**PIPELINE, "pipeline.strategy": "PreferForward"}, rows=PIPELINE_ROWS),
    "2 stages, ZeroBubble": MeasuredLayout(2, {**PIPELINE, "pipeline.strategy": "ZeroBubble"}, rows=PIPELINE_ROWS),
    "2 stages x 2 chunks, interleaved": MeasuredLayout(2, INTERLEAVED, rows=PIPELINE_ROWS),
    "3D split(2) x 2 stages": MeasuredLayout(4, PIPELINE, split=2, rows=PIPELINE_ROWS),
    "3D split(2) x 2 stages x 2 replicas": MeasuredLayout(8, PIPELINE, split=2, rows=PIPELINE_ROWS),
    # the check that the model trains as in one process needs values: the model is on meta
    "context 2": MeasuredLayout(2, {"context.degree": 2, "context.verify": False}),
    # AMP O1 (autocast over float32 weights: epl.planner.Workload.autocast), with and without ZeRO's chunks
    "data parallel 2, AMP O1 bf16": MeasuredLayout(2, AMP),
    "ZeRO v2 x 2, AMP O1 bf16": MeasuredLayout(2, {"zero.level": "v2", **AMP}),
}


def llama_config(model: Mapping[str, Any], sequence: int) -> Any:
    """transformers' LlamaConfig of ``model`` (:data:`MODEL`'s keys), SDPA, for sequences of ``sequence``."""
    from transformers import LlamaConfig

    return LlamaConfig(**model, max_position_embeddings=sequence, attn_implementation="sdpa")


def rank_peak(
    config: Mapping[str, Any], split: int, model: Mapping[str, Any], rows: int, sequence: int, steps: int
) -> dict[str, Any]:
    """One rank: the growth of its resident set from before the model is built (on meta) to its peak over
    ``steps`` Adam steps on ``rows`` sequences a replica, with the planner's layout and the rank's stage."""
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    import epl
    from benchmarks.resident import peak, reset_peak
    from epl.planner import ModelShape
    from epl.planner.from_plan import layout_of, precision_of

    epl.init(epl.Config({"io.check_batches": False, "model.meta_init": True, **config}))
    torch.manual_seed(0)
    baseline = reset_peak()
    with epl.split(split) if split > 1 else contextlib.nullcontext():
        built = LlamaForCausalLM(llama_config(model, sequence))
    shape = ModelShape.of(built)
    engine = epl.parallelize(built, optimizer=lambda p: torch.optim.Adam(p, lr=1e-4, foreach=True))
    parallelized = peak() - baseline
    tokens = torch.randint(0, model["vocab_size"], (rows, sequence), generator=torch.Generator().manual_seed(1))
    started = time.perf_counter()
    peaks = []
    for _ in range(steps):
        engine.step({"input_ids": tokens, "labels": tokens})
        peaks.append(peak() - baseline)
    seconds = (time.perf_counter() - started) / steps
    plan = engine.context.plan
    rank = dist.get_rank()
    global_batch = rows * engine.num_replicas
    return {
        "growth": peak() - baseline,
        "peaks": peaks,
        "parallelized": parallelized,
        "layout": layout_of(plan, engine.context.config, global_batch),
        "shape": shape,
        "stage": min(plan.taskgraphs_on(rank)) % plan.pipeline_size,
        "global_batch": global_batch,
        "precision": precision_of(engine.context.config),
        "step_s": seconds,
        "epl": epl.__file__,
    }


def ranks_and_own(
    fn: Callable[..., dict[str, Any]], world: int, args: tuple[Any, ...], tiny_args: tuple[Any, ...], timeout: float
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Each rank's result of ``fn(*args)`` on ``world`` processes, with its result of ``fn(*tiny_args)``: the same
    run with a tiny model, what the process adds by itself. Resident memory follows what the processes allocate,
    not what glibc keeps (:func:`benchmarks.resident.allocation_tracking_children`)."""
    with allocation_tracking_children():
        ranks = run_ranks(fn, world, *args, timeout=timeout)
        own = run_ranks(fn, world, *tiny_args, timeout=timeout)
    return list(zip(ranks, own, strict=True))


def measure(
    name: str,
    layout: MeasuredLayout,
    model: Mapping[str, Any] = MODEL,
    tiny: Mapping[str, Any] = TINY,
    rows: int | None = None,
    sequence: int = SEQUENCE,
    steps: int = STEPS,
    timeout: float = 900,
) -> list[dict[str, Any]]:
    """Each rank of ``layout``: its stage, measured growth less the process's own, the predicted peak, the error."""
    rows = rows or layout.rows
    ranks = ranks_and_own(rank_peak, layout.world, (layout.config, layout.split, model, rows, sequence, steps),
                          (layout.config, layout.split, tiny, rows, sequence, steps), timeout)  # fmt: skip
    records = []
    for rank, (big, small) in enumerate(ranks):
        record = {
            "layout": name, "rank": rank, "stage": big["stage"], "world": layout.world, "rows": rows,
            "sequence": sequence, "global_batch": big["global_batch"], "shape": dataclasses.asdict(big["shape"]),
            "planner_layout": big["layout"].to_dict(), "measured": big["growth"] - small["growth"],
            "own": small["growth"], "parallelized": big["parallelized"] - small["parallelized"],
            "step_s": big["step_s"], "peaks": big["peaks"], "precision": list(big["precision"]),
        }  # fmt: skip
        records.append(predict(record))
    return records


def predict(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` (a rank's measurement) with the planner's peak for its stage, the moment, the terms and the error."""
    from epl.planner import ModelShape, Workload
    from epl.planner.layout import Layout
    from epl.planner.memory import stage_breakdown

    layout = {key: tuple(v) if isinstance(v, list) else v for key, v in record["planner_layout"].items()}
    dtype, autocast = record.get("precision", ("fp32", False))
    workload = Workload(
        record["global_batch"], record["sequence"], dtype=dtype, autocast=autocast, gathered_logits=True
    )
    breakdown = stage_breakdown(ModelShape(**record["shape"]), Layout(**layout), workload, record["stage"])
    return {**record, "predicted": breakdown.peak, "moment": breakdown.moment, "terms": breakdown.terms,
            "error": breakdown.peak / record["measured"] - 1}  # fmt: skip


def table(records: Iterable[Mapping[str, Any]]) -> str:
    """docs/planner.md's table: layout, rank (stage), predicted and measured GiB, error."""
    lines = ["| layout | rank (stage) | predicted | measured | error |", "|---|---|---|---|---|"]
    for r in records:
        lines.append(
            f"| {r['layout']} | {r['rank']} ({r['stage']}) | {r['predicted'] / GIB:.3f} GiB | "
            f"{r['measured'] / GIB:.3f} GiB | {r['error']:+.1%} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """``python -m benchmarks.planner_memory [NAME ...] [--out FILE] [--again FILE]``: measure (or, with ``--again``,
    predict a measured file's ranks anew with the planner as it is now), write the JSON, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(LAYOUTS), help="layouts of LAYOUTS (default: all)")
    parser.add_argument("--out", default=str(RESULTS / "planner_memory.json"))
    parser.add_argument("--again", metavar="FILE", help="a measured file: predict its ranks again, measuring nothing")
    args = parser.parse_args(argv)
    if args.again:
        with open(args.again) as file:
            out = json.load(file)
        out["records"] = [predict(record) for record in out["records"] if record["layout"] in args.names]
    else:
        started = time.perf_counter()
        records: list[dict[str, Any]] = []
        for name in args.names:
            began = time.perf_counter()
            found = measure(name, LAYOUTS[name])
            records += found
            print("\n".join(table(found).splitlines()[2:]), f"({time.perf_counter() - began:.0f} s)", flush=True)
        out = {"model": MODEL, "tiny": TINY, "sequence": SEQUENCE, "steps": STEPS,
               "seconds": time.perf_counter() - started, "machine": machine_info(), "records": records}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as file:
        json.dump(out, file, indent=1)
    print(table(out["records"]))
    worst = max(abs(r["error"]) for r in out["records"])
    print(f"{len(out['records'])} ranks measured in {out['seconds']:.0f} s; largest error {worst:.1%} "
          f"(within {TOLERANCE:.0%}: {worst <= TOLERANCE})")  # fmt: skip


if __name__ == "__main__":
    main()
