"""The planner against torchtitan's 3D recipe, run here: torch's FSDP2, tensor parallelism and pipelining as
torchtitan runs its Llama 3.1 405B (benchmarks/llama3_h100_202412_torchtitan.md, Table 5), small, on the CPU.

docs/planner.md's published row for that run is predicted 22% under its figure. This check tells apart what the
planner lacks about torch's runtime (FSDP2 under a pipeline, DTensor's plans, torch's pipelining), which it would
lack here too, from what only the GPU run has (the caching allocator, NCCL, compiled and float8 kernels).

**The recipe** (torchtitan @9dec370a; torch's pipelining as of 2.6, whose mechanisms torch 2.13 keeps):

- each pipeline stage is a transformers Llama's blocks, the first stage's with the embedding, the last's with the
  final norm and the head (``pipeline_llama_manual_split``);
- tensor parallelism (:func:`tensor_parallel`, ``Run.tensor``) with torchtitan's plan: sequence parallelism, each
  projection's input gathered whole, the head's logits on vocabulary shards under ``loss_parallel``;
- every block recomputed from its input (``checkpoint_wrapper``, as ``apply_ac``'s ``full``);
- FSDP2 over the data devices, bf16 weights and float32 reduction, not resharded after the forward under a
  pipeline (``apply_fsdp``): each block its own unit, the stage's root the last one;
- torch's ``Schedule1F1B`` over :data:`MICRO_BATCHES` micro-batches (``pipelining_utils.py``), with torchtitan's
  loss, ``cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))``;
- AdamW, ``foreach`` (torch's default on GPUs), ``zero_grad(set_to_none=True)`` before each step.

Not here: float8 and compile. On the CPU, ``torch._scaled_mm`` computes through float32 copies of its operands
(measured: a 8192 x 1024 x 2048 product peaks at 138 MiB where bf16's peaks at 32), so the CPU cannot measure
float8's working set (docs/planner.md).

**Measured per rank** as :mod:`benchmarks.planner_memory` measures: the growth of the resident set from before the
model is built (on meta) to its peak over :data:`STEPS` steps, less the same run's with a tiny model.

**Predicted**: :func:`epl.planner.memory.stage_breakdown` with the settings of the 405B row
(tests/planner/published.py): ``zero_once_per_step`` (the working weights and float32 gradients whole all step),
``weights_prefetched``, ``saves_gathered_inputs`` and ``torch_pipelining``.

``python -m benchmarks.recipe_memory [RUN ...]`` (``nox -s planner-memory`` runs it too) writes
benchmarks/results/recipe_memory.json and prints the table of docs/planner.md ("torchtitan's recipe, measured
here"). CI runs a slice (tests/planner/test_recipe_memory.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import RESULTS, machine_info
from benchmarks.planner_memory import GIB, MODEL, TINY, TOLERANCE, llama_config, ranks_and_own

#: Pipeline stages x data devices (ranks 0 and 1 run the first stage: torchtitan's mesh puts "pp" outermost).
PIPELINE, DATA = 2, 2
#: Micro-batches a step (torchtitan's default is the pipeline degree; 4 puts the first stage's 2 in flight with
#: 2 more waiting).
MICRO_BATCHES = 4
STEPS = 2
#: A narrow Llama (7M parameters) on long micro-batches: the blocks' saved inputs and the recomputed block make
#: two thirds of the first stage's peak (a third on the 405B's, a tenth on the 123M Llama's).
NARROW = {"hidden_size": 256, "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
          "intermediate_size": 704, "vocab_size": 2048}  # fmt: skip


@dataclass(frozen=True)
class Run:
    """One measured run: the model (transformers' LlamaConfig's arguments), micro-batch rows and tokens."""

    model: Mapping[str, Any]
    micro_batch: int
    sequence: int
    #: Tensor-parallel devices, with torchtitan's plan (sequence parallelism and the loss on vocabulary shards).
    tensor: int = 1


#: The runs measured: planner_memory's 123M Llama, and the narrow one whose peak the saved activations shape, on
#: pipeline x data devices and on pipeline x data x tensor devices (torchtitan's 405B layout, 8 processes).
RUNS = {
    "123M Llama, 2 x 256 tokens": Run(MODEL, 2, 256),
    "7M Llama, 8 x 1024 tokens": Run(NARROW, 8, 1024),
    "7M Llama, 8 x 1024 tokens, TP 2": Run(NARROW, 8, 1024, tensor=2),
}


def stage_module(model: Any, stage: int, stages: int, sequence: int) -> Any:
    """The blocks of ``model`` (a transformers ``LlamaForCausalLM``) on pipeline ``stage`` of ``stages``: the
    first with the embedding, the last with the final norm and the head; the positions of ``sequence`` tokens made
    on each stage."""
    import torch
    from torch import nn

    layers = model.model.layers
    per_stage = len(layers) // stages

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            first, last = stage == 0, stage == stages - 1
            self.embed = model.model.embed_tokens if first else None
            self.layers = nn.ModuleList(layers[stage * per_stage : (stage + 1) * per_stage])
            self.rotary = model.model.rotary_emb
            self.norm = model.model.norm if last else None
            self.head = model.lm_head if last else None

        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            hidden = self.embed(inputs) if self.embed is not None else inputs
            positions = torch.arange(sequence).unsqueeze(0)
            rotary = self.rotary(hidden, positions)
            for layer in self.layers:
                hidden = layer(hidden, position_embeddings=rotary, position_ids=positions)
            if self.head is not None:
                hidden = self.head(self.norm(hidden))
            return hidden

    return Stage()


def tensor_parallel(module: Any, mesh: Any) -> None:
    """torchtitan's tensor-parallel plan (@9dec370a ``apply_tp``) on a stage of transformers' Llama: the embedding's
    output and the norms on sequence shards, the projections' inputs gathered whole (``PrepareModuleInput``), the
    head's logits left on vocabulary shards for ``loss_parallel``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    ends = {}
    if module.embed is not None:
        ends["embed"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if module.head is not None:
        ends["norm"] = SequenceParallel()
        ends["head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(module, mesh, ends)
    columns, rows, prepare = ColwiseParallel, RowwiseParallel, PrepareModuleInput
    gathered = {"hidden_states": Replicate()}
    for layer in module.layers:
        parallelize_module(layer, mesh, {
            "input_layernorm": SequenceParallel(),
            "self_attn": prepare(input_kwarg_layouts={"hidden_states": Shard(1)},
                                 desired_input_kwarg_layouts=gathered),
            "self_attn.q_proj": columns(), "self_attn.k_proj": columns(),
            "self_attn.v_proj": columns(), "self_attn.o_proj": rows(output_layouts=Shard(1)),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": prepare(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": columns(), "mlp.up_proj": columns(),
            "mlp.down_proj": rows(output_layouts=Shard(1)),
        })  # fmt: skip


def rank_peak(
    model_args: Mapping[str, Any], micro_batch: int, sequence: int, tensor: int, steps: int
) -> dict[str, Any]:
    """One rank of the recipe: its stage and the growth of its resident set to the peak of ``steps`` steps."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor.parallel import loss_parallel
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from benchmarks.resident import peak, reset_peak
    from epl.planner import ModelShape

    mesh = init_device_mesh("cpu", (PIPELINE, DATA, tensor), mesh_dim_names=("pp", "dp", "tp"))
    stage = mesh["pp"].get_local_rank()
    baseline = reset_peak()
    with torch.device("meta"):
        whole = LlamaForCausalLM(llama_config(model_args, sequence))
    shape = ModelShape.of(whole)
    module = stage_module(whole, stage, PIPELINE, sequence)
    if tensor > 1:
        tensor_parallel(module, mesh["tp"])
    for index, layer in enumerate(module.layers):
        module.layers[index] = checkpoint_wrapper(layer, preserve_rng_state=False)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in module.layers:
        fully_shard(layer, mesh=mesh["dp"], mp_policy=policy, reshard_after_forward=False)
    fully_shard(module, mesh=mesh["dp"], mp_policy=policy, reshard_after_forward=False)
    module.to_empty(device="cpu")
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0.0, 0.02)
    module.rotary = LlamaRotaryEmbedding(whole.config)  # its buffers made on the CPU, not left empty by to_empty

    def loss_fn(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))

    pipeline = PipelineStage(module, stage, PIPELINE, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(pipeline, n_microbatches=MICRO_BATCHES, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4, foreach=True)
    rows = MICRO_BATCHES * micro_batch
    generator = torch.Generator().manual_seed(1 + mesh["dp"].get_local_rank())
    tokens = torch.randint(0, model_args["vocab_size"], (rows, sequence), generator=generator)
    peaks = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        with loss_parallel() if tensor > 1 else contextlib.nullcontext():
            if stage == 0:
                schedule.step(tokens)
            else:
                schedule.step(target=tokens, losses=[])
        optimizer.step()
        peaks.append(peak() - baseline)
    dist.barrier()
    return {"stage": stage, "growth": peak() - baseline, "peaks": peaks, "shape": shape}


def predict(record: Mapping[str, Any]) -> dict[str, Any]:
    """``record`` (a rank's measurement) with the planner's peak for its stage under the 405B row's settings."""
    from epl.planner import Layout, ModelShape, Workload
    from epl.planner.memory import stage_breakdown

    tensor = record.get("tensor", 1)
    layout = Layout(DATA, tensor, PIPELINE, MICRO_BATCHES, record["micro_batch"], "v1", "full", "1F1B",
                    sequence_parallel=tensor > 1)  # fmt: skip
    workload = Workload(DATA * MICRO_BATCHES * record["micro_batch"], record["sequence"], zero_once_per_step=True,
                        weights_prefetched=True, torch_pipelining=True, saves_gathered_inputs=True)  # fmt: skip
    breakdown = stage_breakdown(ModelShape(**record["shape"]), layout, workload, record["stage"])
    return {**record, "predicted": breakdown.peak, "moment": breakdown.moment, "terms": breakdown.terms,
            "error": breakdown.peak / record["measured"] - 1}  # fmt: skip


def measure(name: str, run: Run, steps: int = STEPS) -> list[dict[str, Any]]:
    """Every rank of ``run``: its stage, measured growth less the process's own (the same run with :data:`TINY`),
    the prediction, the error."""
    shape = (run.micro_batch, run.sequence, run.tensor, steps)
    ranks = ranks_and_own(rank_peak, PIPELINE * DATA * run.tensor, (run.model, *shape), (TINY, *shape), 900)
    return [
        predict({"run": name, "rank": rank, "stage": big["stage"], "shape": dataclasses.asdict(big["shape"]),
                 "micro_batch": run.micro_batch, "sequence": run.sequence, "tensor": run.tensor,
                 "measured": big["growth"] - small["growth"],
                 "own": small["growth"], "peaks": big["peaks"]})
        for rank, (big, small) in enumerate(ranks)
    ]  # fmt: skip


def table(records: list[Mapping[str, Any]]) -> str:
    """docs/planner.md's table: rank (stage), predicted and measured GiB, error, the predicted terms."""
    lines = ["| run | rank (stage) | predicted | measured | error | predicted terms (GiB) |", "|---" * 6 + "|"]
    for r in records:
        terms = ", ".join(f"{name} {size / GIB:.3f}" for name, size in r["terms"].items())
        lines.append(f"| {r['run']} | {r['rank']} ({r['stage']}) | {r['predicted'] / GIB:.3f} GiB | "
                     f"{r['measured'] / GIB:.3f} GiB | {r['error']:+.1%} | {r['moment']}: {terms} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """``python -m benchmarks.recipe_memory [--out FILE]``: measure, write the JSON, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(RUNS), help="runs of RUNS (default: all)")
    parser.add_argument("--out", default=str(RESULTS / "recipe_memory.json"))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    records = [record for name in args.names for record in measure(name, RUNS[name])]
    out = {"runs": {name: dataclasses.asdict(RUNS[name]) for name in args.names}, "tiny": TINY,
           "micro_batches": MICRO_BATCHES, "steps": STEPS, "seconds": time.perf_counter() - started,
           "machine": machine_info(), "records": records}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(table(records))
    worst = max(abs(r["error"]) for r in records)
    print(f"{len(records)} ranks in {out['seconds']:.0f} s; largest error {worst:.1%} (tolerance {TOLERANCE:.0%})")


if __name__ == "__main__":
    main()
