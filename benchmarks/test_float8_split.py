"""``float8.enabled`` under ``epl.split(2)``: EPL's float8 shards against torchao's float8 tensor parallelism on
DTensor (``Float8ColwiseParallel``/``Float8RowwiseParallel``, torchtitan's float8 plan), 2 processes on the CPU (gloo)
in the same run.

**The model.** The tensor-parallel benchmark's Llama (``benchmarks/test_split_llama.py``: hidden 512, 4 layers, GQA
8/4, SwiGLU 1376, vocabulary 4096, float32, SDPA), batch 2 x 128, AdamW, the tensorwise recipe (torchao's DTensor
float8 runs tensorwise only). Both sides train the same linears in float8: EPL's choice (the middle two blocks'
linears; the edge blocks, the embedding and the head in float32).

**EPL.** ``float8.enabled`` with ``with epl.split(2): model = LlamaForCausalLM(config)``: each shard's product cast
as the whole layer's, each scale's amax all-reduced over the two devices (``epl.float8.sharded``).

**PyTorch.** The same model converted by ``torchao.float8.convert_to_float8_training`` (the same linears), then
``parallelize_module`` with torchtitan's plan, the float8 linears by torchao's ``Float8ColwiseParallel`` and
``Float8RowwiseParallel``: the weights are DTensors, and torchao takes each amax over the mesh.

**Same step first.** The first loss on both sides within 1e-5 (both scale every operand as the whole layer).

**Measured.** Step time in alternating rounds (rank 0's clock; ratio EPL / DTensor; target <= 1.00 with noise).
On a CPU, float8 matmuls are emulated, so only the ratio means anything.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
from tests.helpers.distributed import run_ranks

from benchmarks.harness import Section, record_step_race, short_mode, step_times

pytest.importorskip("torchao.float8")
warnings.filterwarnings("ignore", module="torchao")
pytestmark = pytest.mark.multiprocess

#: CI (short mode) only catches gross regressions; a full run checks the target with margin for noise.
MAX_RATIO = 2.0 if short_mode() else 1.25
SECTION = Section(
    "float8 under tensor parallelism (float8.enabled, epl.split(2))",
    __file__,
    "Step time of the tensor-parallel benchmark's transformers Llama (hidden 512, 4 layers, float32 master weights, "
    "batch 2 x 128, AdamW, tensorwise float8 on the middle blocks' linears) under `epl.split(2)` with "
    "`float8.enabled`, against the same model converted by torchao and sharded by DTensor's `parallelize_module` "
    "with torchtitan's float8 plan (`Float8ColwiseParallel`/`Float8RowwiseParallel`), 2 processes on the CPU, after "
    "checking both take the same first step. Target <= 1.00.",
)


def float8_plan(converted: set[str], layers: int) -> dict[str, Any]:
    """torchtitan's plan (``benchmarks.test_split_llama.torchtitan_plan``) with torchao's float8 styles on the
    linears in ``converted``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    from benchmarks.test_split_llama import torchtitan_plan

    plan = {name: style for name, style in torchtitan_plan().items() if "layers.*" not in name}
    for index in range(layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):  # fmt: skip
            full = f"model.layers.{index}.{name}"
            row = name.endswith(("o_proj", "down_proj"))
            if full in converted:
                plan[full] = Float8RowwiseParallel() if row else Float8ColwiseParallel()
            else:
                plan[full] = RowwiseParallel() if row else ColwiseParallel()
    return plan


def race_against_torchao(rounds: int, steps: int) -> dict[str, Any]:
    """On this rank: check that EPL and torchao's DTensor float8 take the same first step, then time them."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import epl
    from benchmarks.harness import race_steps
    from benchmarks.test_split_llama import (
        BATCH,
        LAYERS,
        LR,
        SEQUENCE,
        VOCABULARY,
        dtensor_step,
        llama,
        next_token_loss,
    )
    from epl.float8 import choose_linears, convert, float8_config

    torch.set_num_threads(1)
    epl.init(epl.Config({"float8.enabled": True}))
    with epl.split(2):
        ours = llama()
    engine = epl.parallelize(ours, optimizer=lambda p: torch.optim.AdamW(p, lr=LR), loss_fn=next_token_loss)
    theirs = llama()
    converted = set(choose_linears(theirs).converted)
    convert(theirs, converted, float8_config("tensorwise", all_gather=False))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    theirs = parallelize_module(theirs, mesh, float8_plan(converted, LAYERS))
    tokens = torch.randint(0, VOCABULARY, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(1))
    torch_step = dtensor_step(theirs, torch.optim.AdamW(theirs.parameters(), lr=LR), tokens)

    def epl_step() -> torch.Tensor:
        return engine.step(tokens, tokens)

    first = (float(epl_step()), float(torch_step()))
    assert abs(first[0] - first[1]) <= 1e-5 * abs(first[1]), f"EPL and torchao took different first steps: {first}"
    return {**race_steps("float8_split_vs_torchao", torch_step, epl_step, rounds=rounds, steps=steps), "first": first}


def test_float8_split_against_torchao_dtensor() -> None:
    """EPL's float8 shards against torchao's float8 tensor parallelism: the same first loss, then step time."""
    rounds, steps = (3, 1) if short_mode() else (11, 3)
    first, _ = run_ranks(race_against_torchao, 2, rounds, steps, timeout=900)
    detail = f"first loss EPL {first['first'][0]:.6f}, torchao {first['first'][1]:.6f}; " + step_times(first).replace(
        "PyTorch", "torchao DTensor float8"
    )
    record_step_race(
        "float8_split_vs_torchao",
        first,
        feature="`float8.enabled` under `epl.split(2)` (tensorwise), transformers Llama, 2 processes, CPU",
        against="torchao `Float8ColwiseParallel`/`Float8RowwiseParallel` on DTensor, torchtitan plan",
        plot="float8 split vs torchao TP",
        section=SECTION,
        detail=detail,
        max_ratio=MAX_RATIO,
    )
