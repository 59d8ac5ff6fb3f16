"""``float8.enabled`` (torchao's float8 linears): EPL's step against the plain loop with torchao's own conversion, and
on a GPU, float8's tokens/s against bfloat16's.

**On the CPU** (CI, one thread): transformers' Llama (hidden 512, 6 layers, GQA 8/4, SwiGLU 1536, vocabulary 4096,
float32, batch 2 x 128, AdamW), tensorwise recipe. EPL's ``float8.enabled`` against the plain loop whose model
``torchao.float8.convert_to_float8_training`` converted with the same filter (the same linears: EPL's choice), both
first checked to take the same step. The ratio is EPL's overhead (target <= 1.05); float8 against bfloat16 means
nothing on a CPU (its ``_scaled_mm`` emulates float8), so it is not timed here.

**On a GPU** (``.ci/gpu``, marked ``gpu``): transformers' Llama (hidden 2048, 8 layers, GQA 16/8, SwiGLU 5632,
sequence 2048, batch 4), AMP bf16 and compile on both sides, each recipe: tokens/s of EPL with ``float8.enabled``
against EPL without it, in the same run (ratio of step times: below 1, what float8 gives).
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import pytest
import torch

import epl
from benchmarks.harness import ResultRow, Section, compare, record, short_mode

torchao_float8 = pytest.importorskip("torchao.float8")
warnings.filterwarnings("ignore", module="torchao")

HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE, VOCABULARY = 512, 6, 8, 4, 1536, 4096
BATCH, SEQUENCE = 2, 128
MAX_RATIO = 1.5 if short_mode() else 1.05
SECTION = Section(
    "float8 training (float8.enabled)",
    __file__,
    f"Step time of transformers' `LlamaForCausalLM` (hidden {HIDDEN}, {LAYERS} layers, GQA {HEADS}/{KV_HEADS}, "
    f"vocabulary {VOCABULARY}, float32 master weights, batch {BATCH} x {SEQUENCE}, AdamW) with torchao's float8 "
    "linears (tensorwise), one process on the CPU, one thread: EPL's `float8.enabled` against the plain loop whose "
    "model `torchao.float8.convert_to_float8_training` converted with the same filter (EPL's overhead, target "
    "<= 1.05). On a GPU (`.ci/gpu`): float8 against bf16, both compiled, tokens/s.",
)


def llama(**shape: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    sizes = {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
             "num_key_value_heads": KV_HEADS, "intermediate_size": INTERMEDIATE, "vocab_size": VOCABULARY}  # fmt: skip
    sizes.update(shape)
    config = LlamaConfig(**sizes, max_position_embeddings=4096, attn_implementation="sdpa", use_cache=False)
    return LlamaForCausalLM(config)


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


def plain_float8() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The plain loop's model: torchao's conversion of the linears EPL chooses."""
    from epl.float8 import choose_linears

    model = llama()
    chosen = set(choose_linears(model).converted)
    config = torchao_float8.Float8LinearConfig.from_recipe_name("tensorwise")
    torchao_float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda _, name: name in chosen)
    return model, adamw(model.parameters())


def test_float8_step_against_the_plain_loop_with_torchao() -> None:
    torch.set_num_threads(1)
    tokens = torch.randint(0, VOCABULARY, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": tokens, "labels": tokens}
    epl.init(epl.Config({"float8.enabled": True}))
    engine = epl.parallelize(llama(), optimizer=adamw)
    model, optimizer = plain_float8()

    def plain_step() -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        return loss.detach()

    assert abs(float(engine.step(batch)) - float(plain_step())) < 1e-5  # the same first step
    rounds, calls = (3, 1) if short_mode() else (15, 3)
    result = compare("float8_overhead", plain_step, lambda: engine.step(batch), rounds=rounds, calls_per_round=calls,
                     warmup=1, save=False)  # fmt: skip
    feature = "`float8.enabled` (tensorwise), transformers Llama, CPU"
    row = result.row(ResultRow(feature, "plain loop, `convert_to_float8_training`", plot="float8 vs torchao"))
    detail = f"per step, the plain loop with torchao's conversion against EPL: {result.detail()}"
    record("float8", [row], section=SECTION, details=[detail])
    print("\n" + detail)
    assert result.ratio < MAX_RATIO, result.line()


GPU_SHAPE = {"hidden_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 8,
             "intermediate_size": 5632, "vocab_size": 32000}  # fmt: skip
GPU_BATCH, GPU_SEQUENCE = 4, 2048


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_tokens_per_second_against_bf16_on_cuda(recipe: str) -> None:
    """EPL with float8 against EPL in bf16 (AMP), both compiled, in the same run: tokens/s and their ratio."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 needs compute capability 8.9 or more")
    tokens = torch.randint(0, GPU_SHAPE["vocab_size"], (GPU_BATCH, GPU_SEQUENCE), device="cuda")
    batch = {"input_ids": tokens, "labels": tokens}
    base = {"amp.level": "O1", "amp.dtype": "bfloat16", "compile.enabled": True}

    def engine_for(float8: bool) -> Any:
        epl.init(epl.Config({**base, "float8.enabled": float8, "float8.recipe": recipe}))
        return epl.parallelize(llama(**GPU_SHAPE).cuda(), optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4, fused=True))

    bf16, float8 = engine_for(False), engine_for(True)

    def synced(engine: Any) -> Any:
        def step() -> None:
            engine.step(batch)
            torch.cuda.synchronize()

        return step

    start = time.perf_counter()
    first = [float(bf16.step(batch)), float(float8.step(batch))]
    compiling = time.perf_counter() - start
    assert abs(first[0] - first[1]) < 0.1 * first[0], first  # the same model, float8's rounding aside
    rounds, calls = (3, 2) if short_mode() else (10, 5)
    result = compare(f"float8_{recipe}_gpu", synced(bf16), synced(float8), rounds=rounds, calls_per_round=calls,
                     warmup=2, save=False)  # fmt: skip
    per_step = GPU_BATCH * GPU_SEQUENCE
    feature = f"`float8.enabled` ({recipe}), Llama 8 x 2048, {torch.cuda.get_device_name()}"
    row = result.row(ResultRow(feature, "the same engine in bf16 (AMP), both compiled", plot="float8 vs bf16"))
    detail = (
        f"{recipe}: bf16 {per_step / result.baseline_s:,.0f} tokens/s, float8 {per_step / result.epl_s:,.0f} tokens/s, "
        f"step time ratio {result.ratio:.3f} ({result.rounds} rounds x {result.calls_per_round} steps; first steps "
        f"{compiling:.0f} s)"
    )
    record(f"float8_{recipe}_gpu", [row], section=SECTION, details=[detail])
    print("\n" + detail)
