"""``compile.enabled`` on transformers' Llama in one process, on the CPU (inductor's C++ backend): EPL compiled
against EPL eager, and against the plain loop compiled as torchtitan compiles (each block with ``torch.compile``).

**The model.** The tensor-parallel benchmark's Llama (``benchmarks/test_split_llama.py``): hidden 512, 4 layers,
GQA 8/4, SwiGLU 1376, vocabulary 4096, float32, SDPA; batch 2 x 128 tokens; its own loss; AdamW; one thread.

**Same step first.** The compiled engine's first loss equals the eager one's within float32 tolerance.

**Measured.** Step time in alternating rounds after warm-up (the compilation is timed apart: the first step of
each side). Ratios: EPL compiled / EPL eager (below 1: what compiling gives), and EPL compiled / the plain loop
compiled per block (EPL's own overhead with compile; target <= 1.03).
"""

from __future__ import annotations

import time
from typing import Any

import torch

import epl
from benchmarks.harness import ResultRow, Section, compare, ms, record, short_mode

HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE, VOCABULARY = 512, 4, 8, 4, 1376, 4096
BATCH, SEQUENCE = 2, 128
MAX_RATIO = 1.5 if short_mode() else 1.10
SECTION = Section(
    "torch.compile (compile.enabled)",
    __file__,
    f"Step time of transformers' `LlamaForCausalLM` (hidden {HIDDEN}, {LAYERS} layers, GQA {HEADS}/{KV_HEADS}, "
    f"vocabulary {VOCABULARY}, float32, batch {BATCH} x {SEQUENCE}, AdamW) in one process on the CPU, one thread, "
    "each block compiled by inductor: EPL's `compile.enabled` against EPL eager (what compiling gives) and "
    "against the plain loop with each block compiled as torchtitan does (`torch.compile(block, fullgraph=True)`; "
    "EPL's overhead, target <= 1.03). The first step of each, which compiles, is timed apart.",
)


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCABULARY, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=SEQUENCE,
        attn_implementation="sdpa", use_cache=False,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def engine_for(compiled: bool) -> Any:
    epl.init(epl.Config({"compile.enabled": compiled}))
    return epl.parallelize(llama(), optimizer=adamw)


def plain_compiled() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """torchtitan's way: each block replaced by ``torch.compile(block, fullgraph=True)``."""
    model = llama()
    for index, block in enumerate(model.model.layers):
        model.model.layers.register_module(str(index), torch.compile(block, fullgraph=True))
    return model, adamw(model.parameters())


def first_step_seconds(step: Any) -> tuple[float, float]:
    start = time.perf_counter()
    loss = float(step())
    return time.perf_counter() - start, loss


def test_compiled_blocks_against_eager_and_the_plain_loop_compiled() -> None:
    torch.set_num_threads(1)
    tokens = torch.randint(0, VOCABULARY, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": tokens, "labels": tokens}
    eager, compiled = engine_for(False), engine_for(True)
    model, optimizer = plain_compiled()

    def plain_step() -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        return loss.detach()

    eager_first, eager_loss = first_step_seconds(lambda: eager.step(batch))
    compiled_first, compiled_loss = first_step_seconds(lambda: compiled.step(batch))
    plain_first, plain_loss = first_step_seconds(plain_step)
    assert abs(compiled_loss - eager_loss) < 1e-4 and abs(plain_loss - eager_loss) < 1e-4
    report = compiled.compile_report
    assert report is not None and not report.eager, report
    rounds, calls = (3, 2) if short_mode() else (15, 5)
    gain = compare("compile_gain", lambda: eager.step(batch), lambda: compiled.step(batch), rounds=rounds,
                   calls_per_round=calls, warmup=2, save=False)  # fmt: skip
    overhead = compare("compile_overhead", plain_step, lambda: compiled.step(batch), rounds=rounds,
                       calls_per_round=calls, warmup=2, save=False)  # fmt: skip
    feature = "`compile.enabled` (inductor), transformers Llama, CPU"
    rows = [
        gain.row(ResultRow(feature, "the same engine eager", plot="compile vs eager")),
        overhead.row(
            ResultRow(
                feature, "plain loop, each block `torch.compile`d (torchtitan's way)", plot="compile vs plain compiled"
            )
        ),
    ]
    details = [
        f"eager {ms(gain.baseline_s * 1e3)}, compiled {ms(gain.epl_s * 1e3)} per step: ratio {gain.ratio:.3f}",
        f"plain compiled {ms(overhead.baseline_s * 1e3)}, EPL compiled {ms(overhead.epl_s * 1e3)}: "
        f"ratio {overhead.ratio:.3f} ({rounds} rounds x {calls} steps)",
        f"first step (compiling): EPL {compiled_first:.1f} s, plain {plain_first:.1f} s, eager {eager_first:.2f} s; "
        f"{report.describe()}",
    ]
    record("compile", rows, section=SECTION, details=details)
    print("\n" + "\n".join(details))
    assert overhead.ratio < MAX_RATIO, overhead.line()
