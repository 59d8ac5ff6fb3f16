"""Does the planner order layouts as they run here? 10 layouts of a transformers Llama on 2 processes, each step
timed (the fastest of 3 rounds' medians; the layouts take turns), against the planner's prediction with this
machine's profile from ``epl calibrate``.

Reported: the Spearman rank correlation between predicted and measured step times (target >= 0.8), and whether
the fastest measured layout is among the planner's 2 fastest (asserted). The layouts: data parallel with ZeRO
none, v1 and v2 and with checkpointing; split(2) with and without checkpointing; 2 pipeline stages under GPipe,
1F1B and ZeroBubble with 4 micro-batches (predicted alike: the same bubble, and the memory the schedules differ
in does not take time), and 1F1B with 2.
"""

from __future__ import annotations

from typing import Any

import pytest
from tests.helpers.distributed import run_ranks

from benchmarks.harness import Ratio, ResultRow, Section, median_step_seconds, ms, record, short_mode

pytestmark = pytest.mark.multiprocess

HIDDEN, LAYERS, SEQUENCE, BATCH, VOCABULARY = 256, 4, 128, 8, 1024
LAYOUTS: dict[str, tuple[dict[str, Any], int]] = {
    "data parallel": ({}, 1),
    "data parallel, ZeRO v1": ({"zero.level": "v1"}, 1),
    "data parallel, ZeRO v2": ({"zero.level": "v2"}, 1),
    "data parallel, checkpointing": ({"gradient_checkpoint.type": "auto"}, 1),
    "split(2)": ({}, 2),
    "split(2), checkpointing": ({"gradient_checkpoint.type": "auto"}, 2),
    "2 stages, GPipe, 4 micro-batches": ({"pipeline.strategy": "PreferForward", "pipeline.num_micro_batch": 4}, 1),
    "2 stages, 1F1B, 4 micro-batches": ({"pipeline.num_micro_batch": 4}, 1),
    "2 stages, ZeroBubble, 4 micro-batches": ({"pipeline.strategy": "ZeroBubble", "pipeline.num_micro_batch": 4}, 1),
    "2 stages, 1F1B, 2 micro-batches": ({"pipeline.num_micro_batch": 2}, 1),
}
SECTION = Section(
    "Planner: predicted against measured step times",
    __file__,
    f"Spearman rank correlation between the planner's predicted step time (the device profile `epl calibrate` "
    f"measured on this machine) and the measured one, over {len(LAYOUTS)} layouts of a transformers Llama (hidden "
    f"{HIDDEN}, {LAYERS} layers, {BATCH} x {SEQUENCE} tokens, float32) on 2 processes. Target >= 0.8 (shown as "
    "the ratio 'correlation / 0.8'), and the fastest measured layout among the planner's 2 fastest.",
)


def time_layout(name: str, steps: int) -> dict[str, Any]:
    """One rank: the layout's median step time, and the layout as the planner reads it."""
    from contextlib import nullcontext

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import epl
    from epl.planner import ModelShape
    from epl.planner.from_plan import layout_of

    config, split = LAYOUTS[name]
    if "2 stages" in name:
        config = {**config, "pipeline.num_stages": 2, "auto.auto_parallel": True}
    epl.init(epl.Config(config))
    torch.manual_seed(0)
    llama = LlamaConfig(hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCABULARY,
                        max_position_embeddings=SEQUENCE, attn_implementation="sdpa")  # fmt: skip
    with epl.split(split) if split > 1 else nullcontext():
        model = LlamaForCausalLM(llama)
    engine = epl.parallelize(model, optimizer=lambda p: torch.optim.Adam(p, lr=1e-4))
    rows = BATCH // engine.num_replicas
    tokens = torch.randint(0, VOCABULARY, (rows, SEQUENCE), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": tokens, "labels": tokens}
    seconds = median_step_seconds(lambda: engine.step(batch), steps)
    layout = layout_of(engine.context.plan, engine.context.config, BATCH)
    return {"seconds": seconds, "layout": layout, "shape": ModelShape.of(model)}


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation: Pearson's of the ranks, tied values sharing their average rank (the planner
    predicts the three 2-stage schedules with 4 micro-batches alike)."""

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        result = [0.0] * len(values)
        start = 0
        while start < len(order):
            end = start
            while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
                end += 1
            for position in range(start, end + 1):
                result[order[position]] = (start + end) / 2
            start = end + 1
        return result

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    covariance = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    spread = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return covariance / spread


@pytest.mark.timeout(1800)
def test_the_planner_orders_layouts_as_they_run_here() -> None:
    from epl.planner import Workload, estimate
    from epl.planner.calibrate import calibrate

    profile = calibrate(dtype="fp32", seconds=1.0, size=512)
    steps, rounds = (2, 1) if short_mode() else (5, 3)
    measured: dict[str, float] = {}
    predicted: dict[str, float] = {}
    # short mode (CI): one layout of each kind, so that the code runs; the ordering needs them all
    names = ["data parallel", "data parallel, ZeRO v1", "split(2)", "2 stages, 1F1B, 4 micro-batches"]
    names = names if short_mode() else list(LAYOUTS)
    for _ in range(rounds):  # the layouts in turn, each round: a slow minute of the machine hits them all alike
        for name in names:
            first = run_ranks(time_layout, 2, name, steps, timeout=600)[0]
            measured[name] = min(measured.get(name, float("inf")), first["seconds"])
            workload = Workload(BATCH, SEQUENCE, dtype="fp32", devices_per_node=2, gathered_logits=True)
            predicted[name] = estimate(first["shape"], first["layout"], workload, profile).step_time_s
    correlation = spearman([measured[n] for n in names], [predicted[n] for n in names])
    fastest = min(names, key=measured.__getitem__)
    top_two = sorted(names, key=predicted.__getitem__)[:2]
    details = [f"{n}: measured {ms(measured[n] * 1e3)}, predicted {ms(predicted[n] * 1e3)}" for n in names]
    details.append(f"Spearman {correlation:.2f}; fastest measured: {fastest}; planner's top 2: {', '.join(top_two)}")
    row = ResultRow(
        f"Planner step-time ordering, {len(names)} layouts, 2 processes", "the target correlation (0.8)",
        time=(Ratio(correlation / 0.8, "correlation"),), plot="planner ordering (correlation / 0.8)",
    )  # fmt: skip
    record("planner_ordering", [row], section=SECTION, details=details)
    print("\n" + "\n".join(details))
    # The correlation is recorded, not asserted: one layout's step varies by about 5% from run to run here, as much
    # as several layouts differ (docs/planner.md has the runs); the fastest layout's place is asserted.
    if not short_mode():
        assert fastest in top_two, details
