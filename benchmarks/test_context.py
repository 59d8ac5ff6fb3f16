"""Context parallelism's attention modes against each other, on 2 processes (gloo), same run: ring against
all-gather (Llama 3's) and Ulysses against ring.

One attention layer's forward and backward (grouped-query attention: 8 query heads over 2 key/value heads,
head size 64, float32, causal), batch 1 x 2048 tokens spread over the 2 devices, timed in alternating rounds
with a barrier before each (``benchmarks.harness.race_steps``). Before timing, the modes give the same output
(1e-5). Ratios under 1.0: the first mode named is faster. Bytes: the ring and the all-gather send the same
``2(c-1)/c·b·s·h_kv·d`` elements forward; the ring hides nothing behind compute yet (each hop waits), so on a CPU
the difference is the number of messages and their overlap, not the bytes.
"""

from __future__ import annotations

from typing import Any

import pytest
from tests.helpers.distributed import run_ranks

from benchmarks.harness import Section, ms, race_steps, record_step_race, short_mode

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
    from epl.context.chunks import local_positions
    from epl.context.masks import TokenFacts
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
    facts = TokenFacts.of(local_positions(SEQUENCE, group.index, group.count)[None])
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
