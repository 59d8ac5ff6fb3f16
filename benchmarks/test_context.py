"""Context parallelism's attention modes against each other, on 2 processes (gloo), same run: ring against
all-gather (Llama 3's) and Ulysses against ring.

One attention layer's forward and backward (grouped-query attention: 8 query heads over 2 key/value heads,
head size 64, float32, causal), batch 1 x 2048 tokens spread over the 2 devices, timed in alternating rounds
with a barrier before each (``benchmarks.harness.race_steps``). Before timing, the modes give the same output
(1e-5). Ratios under 1.0: the first mode named is faster. Bytes: the ring and the all-gather send the same
``2(c-1)/c·b·s·h_kv·d`` elements forward; the ring hides nothing behind compute yet (each hop waits), so on a CPU
the difference is the number of messages and their overlap, not the bytes.

The blocks' own cost, in one process (no communication), against ``scaled_dot_product_attention`` over the whole
sequence (torch's flash kernel for the CPU): the same layer, forward and backward, time and peak bytes allocated
(``epl_memory.measure.peak_allocated_bytes``), for a device's keys as one block (facts known on the host: one
fused call), the keys in 4 blocks merged by log-sum-exp (the fused kernel per block), and the exact path (facts
read from tensors, as for packed documents or padding: matrix products under the mask).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from tests.helpers.distributed import run_ranks

from benchmarks.harness import (
    Ratio,
    ResultRow,
    Section,
    compare,
    mib,
    ms,
    race_steps,
    record,
    record_step_race,
    short_mode,
)

pytestmark = pytest.mark.multiprocess

HEADS, KV_HEADS, DIM = 8, 2, 64
SEQUENCE = 512 if short_mode() else 2048
MAX_RATIO = 3.0  # gross regressions only: which mode is faster is what the benchmark reports
SECTION = Section(
    "Context parallelism: attention modes",
    __file__,
    f"One causal attention layer (GQA {HEADS}/{KV_HEADS}, head size {DIM}, float32), forward and backward, "
    f"{SEQUENCE} tokens over 2 processes: ring against all-gather (Llama 3's), Ulysses against ring.",
)


def race(rounds: int, steps: int) -> dict[str, Any]:
    import torch

    from epl.context.allgather import allgather_attention
    from epl.context.chunks import local_facts
    from epl.context.ring import ContextGroup, ring_attention
    from epl.context.ulysses import ulysses_attention
    from epl.interfaces.cluster import Cluster
    from epl_comm.torch_communicator import TorchCommunicator

    torch.set_num_threads(1)
    group = ContextGroup(TorchCommunicator.join(Cluster.from_environ(), timeout=120))
    local = SEQUENCE // group.count
    generator = torch.Generator().manual_seed(group.index)
    q = torch.randn(1, HEADS, local, DIM, generator=generator, requires_grad=True)
    k = torch.randn(1, KV_HEADS, local, DIM, generator=generator, requires_grad=True)
    v = torch.randn(1, KV_HEADS, local, DIM, generator=generator, requires_grad=True)
    facts = local_facts(1, SEQUENCE, group.index, group.count)
    modes = {"ring": ring_attention, "allgather": allgather_attention, "ulysses": ulysses_attention}
    outputs = {name: attend(q, k, v, facts, group) for name, attend in modes.items()}
    for name, output in outputs.items():
        torch.testing.assert_close(output, outputs["ring"], rtol=1e-5, atol=1e-5, msg=name)

    def step(name: str) -> Any:
        def run() -> None:
            modes[name](q, k, v, facts, group).sum().backward()

        return run

    return {
        "ring vs allgather": race_steps("ring", step("allgather"), step("ring"), rounds=rounds, steps=steps),
        "ulysses vs ring": race_steps("ulysses", step("ring"), step("ulysses"), rounds=rounds, steps=steps),
    }


@pytest.mark.timeout(900)
def test_context_attention_modes() -> None:
    rounds, steps = (3, 1) if short_mode() else (11, 3)
    results = run_ranks(race, 2, rounds, steps, timeout=800)[0]
    names = {"ring vs allgather": ("all-gather", "ring"), "ulysses vs ring": ("ring", "Ulysses")}
    for key, (baseline, candidate) in names.items():
        result = results[key]
        detail = (
            f"{candidate} {ms(result['epl_ms'])}, {baseline} {ms(result['torch_ms'])} per forward and backward, "
            f"ratio {result['ratio']:.3f} ({result['rounds']} rounds x {result['steps']})"
        )
        record_step_race(
            "context_" + key.replace(" ", "_"),
            result,
            feature=f"Context parallelism, {candidate} attention (2 devices)",
            against=f"{baseline} attention (EPL's)",
            plot=f"context: {candidate} vs {baseline}",
            section=SECTION,
            detail=detail,
            max_ratio=MAX_RATIO,
        )


BLOCKS_SEQUENCE = 512 if short_mode() else 2048
#: Gross regressions only (the exact path's matrix products are several times SDPA's time on a CPU).
BLOCKS_MAX_RATIO = 20.0
BLOCKS_SECTION = Section(
    "Context parallelism: attention blocks against SDPA",
    __file__,
    f"One causal attention layer (GQA {HEADS}/{KV_HEADS}, head size {DIM}, float32), forward and backward, "
    f"{BLOCKS_SEQUENCE} tokens in one process: EPL's blockwise attention against `scaled_dot_product_attention` "
    "over the whole sequence (torch's flash kernel for the CPU), time and peak bytes allocated.",
)


def _blocks_sides() -> tuple[Callable[[], None], dict[str, Callable[[], None]]]:
    """SDPA's forward and backward, and EPL's by each path, on the same inputs."""
    import torch
    import torch.nn.functional as F

    from epl.context.blockwise import KeySlices, blockwise_attention
    from epl.context.masks import Masking, TokenFacts
    from epl.context.ring import ContextGroup, ring_attention

    class _Alone:
        rank, world_size = 0, 1

    group = ContextGroup(_Alone())  # type: ignore[arg-type]
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, BLOCKS_SEQUENCE, DIM, generator=generator, requires_grad=True)
               for n in (HEADS, KV_HEADS, KV_HEADS))  # fmt: skip
    known = TokenFacts.of_runs(((0, BLOCKS_SEQUENCE),), 1)
    read = TokenFacts.of(torch.arange(BLOCKS_SEQUENCE)[None])
    attend = {
        "one block": lambda: ring_attention(q, k, v, known, group),
        "4 blocks": lambda: blockwise_attention(q, k, v, known, KeySlices(known, 4), Masking(), DIM**-0.5),
        "exact path": lambda: ring_attention(q, k, v, read, group),
    }
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for name, fn in attend.items():
        torch.testing.assert_close(fn(), expected, rtol=1e-5, atol=1e-5, msg=name)

    def step(forward: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            torch.autograd.grad(forward().sum(), (q, k, v))

        return run

    sdpa = step(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    return sdpa, {name: step(fn) for name, fn in attend.items()}


def test_context_attention_blocks_against_sdpa() -> None:
    import torch

    from epl_memory.measure import peak_allocated_bytes

    torch.set_num_threads(1)
    sdpa, sides = _blocks_sides()
    rounds, calls = (2, 1) if short_mode() else (7, 2)
    sdpa_peak = peak_allocated_bytes(sdpa)
    rows, details = [], []
    for name, side in sides.items():
        got = compare(f"context blocks, {name}", sdpa, side, rounds=rounds, calls_per_round=calls, warmup=1, save=False)
        peak = peak_allocated_bytes(side)
        rows.append(
            ResultRow(
                f"Context attention blocks, {name}, one process, {BLOCKS_SEQUENCE:,} tokens (CPU)",
                "`scaled_dot_product_attention`",
                time=(Ratio(got.ratio),),
                memory=(Ratio(peak / sdpa_peak, "peak"),),
                plot=f"context blocks ({name}) vs SDPA",
            )
        )
        details.append(
            f"{name}: SDPA {ms(got.baseline_s * 1e3)}, EPL {ms(got.epl_s * 1e3)} per forward and backward "
            f"(ratio {got.ratio:.2f}); peak SDPA {mib(sdpa_peak)}, EPL {mib(peak)} (ratio {peak / sdpa_peak:.2f})"
        )
        print(details[-1])
        assert got.ratio < BLOCKS_MAX_RATIO, details[-1]
    record("context_blocks", rows, section=BLOCKS_SECTION, details=details)
