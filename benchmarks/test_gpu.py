"""EPL on one CUDA GPU against plain PyTorch in the same run: step overhead, AMP, checkpointing, offload, a 1B Llama.

Skipped without CUDA (CI has none). ``.ci/gpu`` runs this file with the CUDA tests on a machine
with one NVIDIA GPU, PyTorch preinstalled and no internet; each comparison first checks that both
sides take the same step, then times them in alternating rounds (each call ends in
``torch.cuda.synchronize()``, so the clock covers the GPU's work). Memory is
``torch.cuda.max_memory_allocated`` over a step.

* **Local step:** a 1024-wide 3-layer MLP, batch 256, Adam: EPL's ``engine.step`` over the
  plain loop on the engine's own model and optimizer (EPL's overhead per step; target <= 1.03).
* **AMP bf16:** transformers' Llama (hidden 1024, 8 layers, sequence 1024, batch 8) under
  ``amp.level O1, amp.dtype bfloat16`` against ``torch.autocast("cuda", torch.bfloat16)``.
* **Checkpointing:** the same Llama, bf16, ``gradient_checkpoint.type auto`` against
  transformers' own ``gradient_checkpointing_enable`` (non-reentrant ``torch.utils.checkpoint``).
* **Offload:** ``offload.level v0`` (FSDP2's CPU offload) on a 0.4B Llama, at 1 and 4 micro-batches a step: step
  time and device memory against the same model kept on the GPU.
* **Llama 1B:** transformers' Llama with TinyLlama's shape (1.1B parameters, 22 layers, hidden
  2048, GQA 32/4), sequence 2048, batch 4, AdamW (fused), AMP bf16 and checkpointing on both
  sides: tokens/s and MFU (PaLM's FLOPs, ``6·N + 12·L·h·s`` per token, recomputation not
  counted, over the GPU's dense bf16 peak). Run twice: eager, and compiled (``compile.enabled`` against each
  block ``torch.compile``d in the plain loop, as torchtitan does).
* **Context attention blocks:** EPL's ring attention on one device (no communication), bf16, 32 query heads over
  8, 4,096 and 8,192 tokens, causal, forward and backward, against ``scaled_dot_product_attention``: time and peak
  memory, with the targets (at most 1.3x and 1.2x) printed, not asserted.
* **Pipelines on 4 GPUs** (skipped, saying so, with fewer): ``benchmarks/test_pipeline.py``'s race, one stage
  per GPU over NCCL: GPipe, 1F1B and ZeroBubble against ``torch.distributed.pipelining`` (ZeroBubble against its
  ``Schedule1F1B``; target <= 1.0, which the 2-core CPU cannot measure: its stages share cores).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import epl
from benchmarks.harness import Ratio, ResultRow, Section, compare, mib, ms, record, short_mode

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

#: Dense bf16 peak of the GPUs the suite knows (epl.planner's device profiles); others report no MFU.
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2250e12, "L40S": 362e12}


def _section(title: str, text: str) -> Section:
    return Section(f"GPU: {title}", __file__, text)


def synced(fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` followed by a CUDA synchronize, so a wall clock covers the GPU's work."""

    def call() -> None:
        fn()
        torch.cuda.synchronize()

    return call


def alternate(baseline: Callable[[], object], candidate: Callable[[], object], rounds: int, calls: int) -> dict:
    """Median seconds per call of each (every call synchronized), timed in alternating rounds by the harness's
    :func:`compare`, and the median of the per-round ratios."""
    got = compare(
        "gpu", synced(baseline), synced(candidate), rounds=rounds, calls_per_round=calls, warmup=2, save=False
    )
    return {"base_s": got.baseline_s, "epl_s": got.epl_s, "ratio": got.ratio}


def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak device bytes allocated during ``fn`` (its second call: gradients made once already)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


@contextlib.contextmanager
def fresh_device() -> Iterator[None]:
    """Empty the caching allocator before and after (each benchmark measures its own memory)."""
    torch.cuda.empty_cache()
    try:
        yield
    finally:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def llama(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocabulary: int) -> nn.Module:
    """transformers' LlamaForCausalLM with random weights from seed 0, built on the GPU, SDPA attention."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        vocab_size=vocabulary,
        max_position_embeddings=4096,
        attn_implementation="sdpa",
        use_cache=False,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        return transformers.LlamaForCausalLM(config)


def llama_on_meta(**shape: int) -> nn.Module:
    """:func:`llama`'s model without values (to count its parameters)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=shape["hidden"], num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], intermediate_size=shape["intermediate"], vocab_size=shape["vocabulary"],
    )  # fmt: skip
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def hf_checkpointing(model: nn.Module) -> None:
    """transformers' own gradient checkpointing, non-reentrant (its newer name first)."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def plain_llama_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, amp: bool = True
) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
        loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    return loss.detach()


def epl_engine(model: nn.Module, config: dict[str, Any], optimizer: Callable[..., torch.optim.Optimizer]) -> Any:
    epl.init(epl.Config(config))
    return epl.parallelize(model, optimizer=optimizer)


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-5, fused=True)


def test_local_step_overhead_on_cuda() -> None:
    width, batch = 1024, 256
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
    loss_fn = nn.CrossEntropyLoss()
    epl.init()
    engine = epl.parallelize(model.cuda(), optimizer=lambda p: torch.optim.Adam(p, lr=1e-3), loss_fn=loss_fn)
    x, y = torch.randn(batch, width, device="cuda"), torch.randint(0, 10, (batch,), device="cuda")
    model, opt = engine.model, engine.optimizer

    def plain() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    rounds, calls = (3, 5) if short_mode() else (21, 50)
    got = alternate(plain, lambda: engine.step(x, y), rounds, calls)
    row = ResultRow(
        "Local `engine.step` on CUDA",
        "plain PyTorch loop (same model and optimizer)",
        time=(Ratio(got["ratio"]),),
        plot="local step on CUDA vs plain loop",
    )
    detail = f"plain {ms(got['base_s'] * 1e3)}, EPL {ms(got['epl_s'] * 1e3)} per step, ratio {got['ratio']:.3f}"
    record(
        "gpu_local_step",
        [row],
        section=_section("local step", "EPL's `engine.step` over the plain loop on one GPU (target <= 1.03)."),
        details=[detail],
    )
    print(detail)
    assert got["ratio"] < 1.5, detail


MID = {"hidden": 1024, "layers": 8, "heads": 16, "kv_heads": 4, "intermediate": 2816, "vocabulary": 32000}


def _tokens(batch: int, sequence: int, vocabulary: int) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(1)
    return torch.randint(0, vocabulary, (batch, sequence), device="cuda", generator=generator)


def _amp_case(
    name: str, config: dict[str, Any], checkpoint: bool, tokens: torch.Tensor, rounds: int, calls: int
) -> tuple[ResultRow, str]:
    """One row: EPL under ``config`` against the plain bf16 loop (with transformers' checkpointing if asked)."""
    with fresh_device():
        plain = llama(**MID)
        if checkpoint:
            hf_checkpointing(plain)
        plain_opt = adamw(plain.parameters())
        engine = epl_engine(llama(**MID), config, adamw)
        batch = {"input_ids": tokens, "labels": tokens}
        first = (float(plain_llama_step(plain, plain_opt, tokens)), float(engine.step(batch)))
        assert abs(first[0] - first[1]) < 1e-2 * abs(first[0]), first  # bf16: the same step, not bit for bit
        peaks = (
            peak_bytes(lambda: plain_llama_step(plain, plain_opt, tokens)),
            peak_bytes(lambda: engine.step(batch)),
        )
        got = alternate(lambda: plain_llama_step(plain, plain_opt, tokens), lambda: engine.step(batch), rounds, calls)
    against = "`torch.autocast` bf16" + (" + transformers' checkpointing" if checkpoint else "")
    row = ResultRow(
        f"{name}, Llama 8 x 1024 on CUDA",
        against,
        time=(Ratio(got["ratio"]),),
        memory=(Ratio(peaks[1] / peaks[0], "step peak"),),
        plot=f"{name} on CUDA",
    )
    detail = (
        f"{name}: plain {ms(got['base_s'] * 1e3)}, EPL {ms(got['epl_s'] * 1e3)} per step (ratio "
        f"{got['ratio']:.3f}); step peak plain {mib(peaks[0])}, EPL {mib(peaks[1])}; first loss {first}"
    )
    return row, detail


def test_amp_bf16_and_checkpointing_on_cuda() -> None:
    batch, sequence = (2, 256) if short_mode() else (8, 1024)
    tokens = _tokens(batch, sequence, MID["vocabulary"])
    rounds, calls = (3, 1) if short_mode() else (9, 3)
    amp = {"amp.level": "O1", "amp.dtype": "bfloat16"}
    cases = [
        _amp_case("AMP bf16", amp, False, tokens, rounds, calls),
        _amp_case("AMP bf16 + checkpointing", {**amp, "gradient_checkpoint.type": "auto"}, True, tokens, rounds, calls),
    ]
    rows, details = [row for row, _ in cases], [detail for _, detail in cases]
    text = (
        f"transformers' Llama (hidden 1024, 8 layers, GQA 16/4, vocabulary 32000), batch {batch} x {sequence}, "
        "fused AdamW: EPL's AMP (and checkpointing) against PyTorch's own in a plain loop."
    )
    record("gpu_amp_checkpointing", rows, section=_section("AMP bf16 and checkpointing", text), details=details)
    print("\n".join(details))
    for row in rows:
        assert row.time[0].value < 1.5, details


#: The offload benchmark's Llama (about 0.4B parameters: 1.6 GB of float32 weights, 6.4 GB with AdamW's state).
OFFLOAD_LLAMA = {"hidden": 1024, "layers": 24, "heads": 16, "kv_heads": 4, "intermediate": 2816, "vocabulary": 32000}


def median_seconds(fn: Callable[[], object], calls: int) -> float:
    """Median seconds of ``calls`` synchronized calls of ``fn`` after one warm-up call (one side alone: the two sides
    of the offload benchmark cannot share the device's memory)."""
    call = synced(fn)
    call()
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def _on_the_gpu(shape: dict[str, int], tokens: torch.Tensor, micro: int, calls: int) -> dict[str, float]:
    """Llama kept on the GPU with fused AdamW: step seconds and peak bytes."""
    with fresh_device():
        model = llama(**shape)
        hf_checkpointing(model)
        optimizer = adamw(model.parameters())

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            for rows in tokens.chunk(micro):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    (model(input_ids=rows, labels=rows).loss / micro).backward()
            optimizer.step()

        return {"peak": peak_bytes(step), "seconds": median_seconds(step, calls)}


def _offloaded(
    shape: dict[str, int], tokens: torch.Tensor, micro: int, calls: int, overlap: bool = False
) -> dict[str, float]:
    """The same Llama under ``offload.level v0`` (fused AdamW on the CPU; ``overlap``: ``offload.overlap_step``): step
    seconds, peak and held bytes, and the CPU's optimizer step alone."""
    config = {"amp.level": "O1", "amp.dtype": "bfloat16", "gradient_checkpoint.type": "auto"}
    config.update({"pipeline.num_micro_batch": micro, "offload.level": "v0", "offload.overlap_step": overlap})
    with fresh_device():
        before = torch.cuda.memory_allocated()
        engine = epl_engine(llama(**shape), config, adamw)  # the same fused AdamW: torch's CPU kernel steps the host
        held = torch.cuda.memory_allocated() - before
        batch = {"input_ids": tokens, "labels": tokens}
        peak = peak_bytes(lambda: engine.step(batch))
        seconds = median_seconds(lambda: engine.step(batch), calls)
        started = time.perf_counter()
        engine.optimizer.step()  # the CPU's step alone (on the last step's gradients)
        return {"peak": peak, "seconds": seconds, "held": held, "cpu_step": time.perf_counter() - started}


def offload_against_the_gpu() -> dict[str, Any]:
    """One process: a step of transformers' Llama with everything on the GPU, and under ``offload.level v0`` (AMP
    bf16 and checkpointing on both), at one and at four micro-batches a step (where compute dominates)."""
    torch.set_num_threads(os.cpu_count() or 1)  # the CPU's optimizer step uses every core (run_ranks gives one)
    shape = dict(OFFLOAD_LLAMA, layers=2) if short_mode() else OFFLOAD_LLAMA
    sequence = 512 if short_mode() else 2048
    # (micro-batches, sequences a step): one step of 8 sequences whole or in 4, then 8 micro-batches of 8 (where the
    # GPU's compute outweighs the CPU's step and the copies)
    steps = ((1, 2), (2, 2)) if short_mode() else ((1, 8), (4, 8), (8, 64))
    calls = 2 if short_mode() else 3
    parameters = sum(p.numel() for p in llama_on_meta(**shape).parameters())
    cases = []
    for micro, batch in steps:
        tokens = _tokens(batch, sequence, shape["vocabulary"])
        gpu, offloaded = _on_the_gpu(shape, tokens, micro, calls), _offloaded(shape, tokens, micro, calls)
        overlapped = _offloaded(shape, tokens, micro, calls, overlap=True)
        cases.append({"micro_batches": micro, "sequences": batch, "length": sequence, "gpu": gpu, "offload": offloaded,
                      "overlapped": overlapped})  # fmt: skip
    return {"parameters": parameters, "cases": cases}


def test_offload_against_the_model_on_the_gpu() -> None:
    from tests.helpers.distributed import run_ranks

    (got,) = run_ranks(offload_against_the_gpu, 1, timeout=900)  # its own process: offload makes a process group
    rows, details = [], []
    name = torch.cuda.get_device_name(0)
    for case in got["cases"]:
        micro, gpu, offloaded, overlapped = case["micro_batches"], case["gpu"], case["offload"], case["overlapped"]
        ratio = offloaded["seconds"] / gpu["seconds"]
        overlapped_ratio = overlapped["seconds"] / gpu["seconds"]
        for label, result, each in (("", offloaded, ratio), (" + overlap_step", overlapped, overlapped_ratio)):
            rows.append(
                ResultRow(
                    f"Offload v0{label}, Llama {got['parameters'] / 1e9:.2f}B, {case['sequences']} sequences in "
                    f"{micro} micro-batch{'es' if micro > 1 else ''}",
                    "the model kept on the GPU",
                    time=(Ratio(each),),
                    memory=(Ratio(result["peak"] / gpu["peak"], "step peak"),),
                    plot=f"offload v0{label}, {case['sequences']} sequences / {micro}",
                )
            )
        details.append(
            f"{name}, AMP bf16 + checkpointing, {case['sequences']} sequences of {case['length']} tokens in {micro} "
            f"micro-batches: step offload {ms(offloaded['seconds'] * 1e3)}, with offload.overlap_step "
            f"{ms(overlapped['seconds'] * 1e3)} (x{overlapped_ratio:.2f}), "
            f"on the GPU {ms(gpu['seconds'] * 1e3)} (x{ratio:.2f}); the CPU's AdamW step alone "
            f"{ms(offloaded['cpu_step'] * 1e3)}; device memory held after parallelize "
            f"{mib(max(offloaded['held'], 0))}, "
            f"step peak offload {mib(offloaded['peak'])}, on the GPU {mib(gpu['peak'])}"
        )
    text = (
        "`offload.level v0` (FSDP2's CPU offload: weights, gradients and AdamW's state in pinned host memory, the "
        "step on the CPU) against the same Llama kept on the GPU, one process, fused AdamW, AMP bf16 and "
        "checkpointing on both."
    )
    record("gpu_offload", rows, section=_section("offload", text), details=details)
    print("\n".join(details))
    assert all(case["offload"]["peak"] < case["gpu"]["peak"] for case in got["cases"]), details


ONE_B = {"hidden": 2048, "layers": 22, "heads": 32, "kv_heads": 4, "intermediate": 5632, "vocabulary": 32000}


def model_flops_per_token(model: nn.Module, shape: dict[str, int], sequence: int) -> float:
    """PaLM's 6·N + 12·L·h·s, N the weights of the blocks and the head (the input embedding not counted)."""
    weights = sum(p.numel() for p in model.parameters()) - shape["vocabulary"] * shape["hidden"]
    return 6 * weights + 12 * shape["layers"] * shape["hidden"] * sequence


def compile_blocks_as_torchtitan(model: nn.Module) -> None:
    """Each transformer block replaced by ``torch.compile(block)``, as torchtitan compiles (after checkpointing)."""
    for index, block in enumerate(model.model.layers):
        model.model.layers.register_module(str(index), torch.compile(block))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compile"])
def test_llama_1b_tokens_per_second_and_mfu(compiled: bool) -> None:
    shape = dict(ONE_B, layers=2) if short_mode() else ONE_B
    batch, sequence = (1, 512) if short_mode() else (4, 2048)
    tokens = _tokens(batch, sequence, shape["vocabulary"])
    config = {"amp.level": "O1", "amp.dtype": "bfloat16", "gradient_checkpoint.type": "auto"}
    config["compile.enabled"] = compiled
    rounds, calls = (3, 1) if short_mode() else (7, 3)
    with fresh_device():
        plain = llama(**shape)
        hf_checkpointing(plain)
        if compiled:
            compile_blocks_as_torchtitan(plain)
        plain_opt = adamw(plain.parameters())
        engine = epl_engine(llama(**shape), config, adamw)
        batch_dict = {"input_ids": tokens, "labels": tokens}
        first = (float(plain_llama_step(plain, plain_opt, tokens)), float(engine.step(batch_dict)))
        assert abs(first[0] - first[1]) < 1e-2 * abs(first[0]), first
        if compiled:
            assert engine.compile_report is not None and not engine.compile_report.eager, engine.compile_report
        got = alternate(
            lambda: plain_llama_step(plain, plain_opt, tokens), lambda: engine.step(batch_dict), rounds, calls
        )
        peak = peak_bytes(lambda: engine.step(batch_dict))
        flops = model_flops_per_token(plain, shape, sequence)
        parameters = sum(p.numel() for p in plain.parameters())
    name = torch.cuda.get_device_name(0)
    peak_flops = next((value for key, value in PEAK_BF16.items() if key in name), None)
    per_step = batch * sequence
    tps = {"plain": per_step / got["base_s"], "epl": per_step / got["epl_s"]}
    mfu = {k: v * flops / peak_flops for k, v in tps.items()} if peak_flops else None
    mfu_text = f"MFU plain {mfu['plain']:.1%}, EPL {mfu['epl']:.1%}" if mfu else f"MFU: no bf16 peak known for {name}"
    settings = "AMP bf16 + checkpointing + compile" if compiled else "AMP bf16 + checkpointing"
    detail = (
        f"{name}, {settings}: {parameters / 1e9:.2f}B parameters, batch {batch} x {sequence}; tokens/s plain "
        f"{tps['plain']:,.0f}, EPL {tps['epl']:,.0f} (step ratio {got['ratio']:.3f}); {mfu_text}; EPL step peak "
        f"{mib(peak)}; first loss {first}"
    )
    row = ResultRow(
        f"Llama 1.1B, {settings}, one GPU",
        "the same in a plain PyTorch loop",
        time=(Ratio(got["ratio"]),),
        plot=f"Llama 1.1B on one GPU{', compiled' if compiled else ''}",
    )
    text = (
        "Tokens/s and MFU of transformers' Llama with TinyLlama's shape on one GPU, EPL (`amp.level O1` bf16, "
        "`gradient_checkpoint.type auto`, and `compile.enabled` in the compiled run) against a plain loop with "
        "`torch.autocast`, transformers' own checkpointing and, compiled, each block `torch.compile`d as torchtitan "
        "does; fused AdamW on both."
    )
    record(f"gpu_llama_1b{'_compile' if compiled else ''}", [row], section=_section("Llama 1.1B", text),
           details=[detail])  # fmt: skip
    print(detail)
    assert got["ratio"] < 1.5, detail


#: The issue's targets for one device's context attention against SDPA (printed, not asserted).
CONTEXT_TIME_TARGET, CONTEXT_MEMORY_TARGET = 1.3, 1.2


@pytest.mark.parametrize("sequence", [4096, 8192])
def test_context_attention_blocks_against_sdpa(sequence: int) -> None:
    """One device's ring attention over its whole sequence (no communication: a group of one), bf16, causal, forward
    and backward, against ``scaled_dot_product_attention``: the cost of EPL's blocks (torch's flash kernel, one call
    per block, keys and values not expanded, merged by log-sum-exp) before any communication."""
    from epl.context.chunks import local_facts
    from epl.context.ring import ContextGroup, ring_attention

    class _Alone:
        rank, world_size = 0, 1

    group = ContextGroup(_Alone())  # type: ignore[arg-type]
    sequence = 1024 if short_mode() else sequence
    heads, kv_heads, dim = 32, 8, 128
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, n, sequence, dim, device="cuda", dtype=torch.bfloat16, generator=generator)
               .requires_grad_() for n in (heads, kv_heads, kv_heads))  # fmt: skip
    facts = local_facts(1, sequence, 0, 1, device="cuda")  # made on the host, as a batch without position_ids

    def sdpa() -> None:
        torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum(), (q, k, v))

    def blocks() -> None:
        torch.autograd.grad(ring_attention(q, k, v, facts, group).sum(), (q, k, v))

    with torch.no_grad():
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        found = ring_attention(q, k, v, facts, group)
        assert float((found - expected).abs().max()) < 3e-2
    with fresh_device():
        sdpa_peak = peak_bytes(sdpa)
    with fresh_device():
        blocks_peak = peak_bytes(blocks)
    rounds, calls = (3, 2) if short_mode() else (7, 5)
    got = alternate(sdpa, blocks, rounds, calls)
    memory = blocks_peak / sdpa_peak
    row = ResultRow(
        f"Context attention blocks, one device, {sequence:,} tokens, bf16 (CUDA)",
        "`scaled_dot_product_attention`",
        time=(Ratio(got["ratio"]),),
        memory=(Ratio(memory, "peak"),),
        plot=f"context blocks vs SDPA on CUDA, {sequence} tokens",
    )
    met = got["ratio"] <= CONTEXT_TIME_TARGET and memory <= CONTEXT_MEMORY_TARGET
    detail = (
        f"{sequence:,} tokens, {heads} heads over {kv_heads}, head size {dim}, causal, forward and backward: SDPA "
        f"{ms(got['base_s'] * 1e3)}, EPL's blocks {ms(got['epl_s'] * 1e3)} (ratio {got['ratio']:.2f}, target "
        f"<= {CONTEXT_TIME_TARGET}); peak SDPA {mib(sdpa_peak)}, EPL {mib(blocks_peak)} (ratio {memory:.2f}, target "
        f"<= {CONTEXT_MEMORY_TARGET}): targets {'met' if met else 'NOT met'}"
    )
    text = "EPL's context attention on one device (no communication) against SDPA: the kernels' own cost."
    record(f"gpu_context_blocks_{sequence}", [row], section=_section("context attention blocks", text),
           details=[detail])  # fmt: skip
    print(detail)
    assert got["ratio"] < 20, detail


def _gpus() -> int:
    return torch.cuda.device_count()


@pytest.mark.timeout(900)
@pytest.mark.skipif(_gpus() < 4, reason=f"needs 4 GPUs, one per pipeline stage; this machine has {_gpus()}")
def test_pipeline_schedules_on_four_gpus() -> None:
    """The CPU pipeline race with a GPU per stage: where ZeroBubble's filled bubbles can show."""
    from benchmarks import test_pipeline as race

    figures = race.run(4, *((5, 2) if short_mode() else (15, 4)))
    rows, details = [], []
    for name, (_, schedule) in race.SCHEDULES.items():
        timing, label = figures[name], race.LABELS[name]
        rows.append(
            ResultRow(
                f"Pipeline {label}, 4 stages on 4 GPUs",
                f"torch.distributed.pipelining `{schedule}`",
                time=(Ratio(timing["ratio"]),),
                plot=f"pipeline {label}, 4 GPUs",
            )
        )
        details.append(
            f"{label}: torch {ms(timing['torch_ms'])}, EPL {ms(timing['epl_ms'])} per step, ratio "
            f"{timing['ratio']:.3f}; EPL measured bubble {timing['epl_measured_bubble']:.3f}"
        )
    text = (
        "Step time of EPL's pipeline over `torch.distributed.pipelining`, the CPU race's 8-layer MLP (width 512, "
        "batch 256 in 8 micro-batches) with one stage per GPU over NCCL, rank 0's clock. Target <= 1.00."
    )
    record("gpu_pipeline", rows, section=_section("pipelines on 4 GPUs", text), details=details)
    print("\n".join(details))
    race.check(figures, 4)
