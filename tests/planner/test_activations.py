"""The planner's activation count reproduces Korthikanti et al. 2022's formulas on GPT's shapes."""

from __future__ import annotations

import pytest

from epl.planner.activations import block_activations, micro_batches_in_flight
from epl.planner.layout import Layout
from epl.planner.shape import ModelShape

#: GPT-3 175B's block (Korthikanti's Table 3): h 12288, 96 heads, f = 4h, no gate, s 2048.
GPT3 = ModelShape(layers=96, hidden=12288, heads=96, kv_heads=96, ffn=4 * 12288, vocab=51200, gated=False)
S, B = 2048, 1


def korthikanti(t: int, sequence_parallel: bool = False) -> float:
    """Bytes per block, section 4 of the paper: sbh(10 + 24/t + 5as/(ht)), or sbh(34 + 5as/h)/t with SP."""
    s, b, h, a = S, B, GPT3.hidden, GPT3.heads
    if sequence_parallel:
        return s * b * h * (34 + 5 * a * s / h) / t
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


@pytest.mark.parametrize("t", [1, 2, 8])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_gpt_blocks_save_what_korthikanti_counts(t: int, sequence_parallel: bool) -> None:
    block = block_activations(GPT3, B, S, sdpa=False, dropout=True)
    assert block.per_device(t, sequence_parallel) == pytest.approx(korthikanti(t, sequence_parallel))


def test_selective_and_full_recomputation_keep_what_the_paper_says() -> None:
    s, b, h = S, B, GPT3.hidden
    selective = block_activations(GPT3, B, S, sdpa=False, dropout=True, checkpoint="auto")
    assert selective.per_device(8, True) == pytest.approx(34 * s * b * h / 8)
    full = block_activations(GPT3, B, S, sdpa=False, dropout=True, checkpoint="full")
    assert full.per_device(8, True) == pytest.approx(2 * s * b * h / 8)


def test_the_schedules_keep_their_micro_batches_in_flight() -> None:
    def layout(schedule: str, virtual: int = 1) -> Layout:
        return Layout(1, 1, 4, 16, 1, schedule=schedule, virtual_stages=virtual)  # type: ignore[arg-type]

    assert micro_batches_in_flight(layout("GPipe")) == 16
    assert micro_batches_in_flight(layout("1F1B")) == 4
    assert micro_batches_in_flight(layout("interleaved", 2)) == pytest.approx(4 * (1 + 3 / 8))
    assert micro_batches_in_flight(layout("1F1B"), stage=3) == 1
    assert micro_batches_in_flight(layout("ZeroBubble"), stage=3) == 4
