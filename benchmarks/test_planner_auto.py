"""``auto.auto_parallel: "plan"`` (the layout ``epl plan --auto`` chooses) against the layouts a user would write
without the planner: data parallelism only, and ``epl.split`` over all devices. The same unannotated transformers
Llama on 2 processes, the device profile ``epl calibrate`` measured on this machine; each layout's median step,
the layouts taking turns over rounds. Target: the planner's layout at most as slow as the faster of the two.
"""

from __future__ import annotations

from typing import Any

import pytest
from tests.helpers.distributed import run_ranks

from benchmarks.harness import Ratio, ResultRow, Section, median_step_seconds, ms, record, short_mode

pytestmark = pytest.mark.multiprocess

HIDDEN, LAYERS, SEQUENCE, BATCH, VOCABULARY = (128, 2, 64, 4, 512) if short_mode() else (384, 6, 128, 8, 8192)
SECTION = Section(
    "Planner: the chosen layout against the default ones",
    __file__,
    f"Median step time of an unannotated transformers Llama (hidden {HIDDEN}, {LAYERS} layers, vocabulary "
    f'{VOCABULARY}, {BATCH} x {SEQUENCE} tokens, float32, Adam) on 2 processes under `auto.auto_parallel: "plan"` '
    "(the planner's fastest layout for the profile `epl calibrate` measured here), over data parallelism and over "
    "`epl.split(2)`, the layouts a user writes without the planner. Target <= 1.0 against the faster of the two.",
)


def time_layout(layout: str, profile: str, steps: int) -> dict[str, Any]:
    """One rank: the layout's median step time, and what the planner chose."""
    from contextlib import nullcontext

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import epl
    from epl.planner.from_plan import layout_of

    config: dict[str, Any] = {}
    if layout == "planned":
        config = {"auto.auto_parallel": "plan", "planner.device": profile, "planner.global_batch_size": BATCH,
                  "planner.sequence_length": SEQUENCE}  # fmt: skip
    epl.init(epl.Config(config))
    torch.manual_seed(0)
    llama = LlamaConfig(hidden_size=HIDDEN, intermediate_size=HIDDEN * 8 // 3, num_hidden_layers=LAYERS,
                        num_attention_heads=8, num_key_value_heads=4, vocab_size=VOCABULARY,
                        max_position_embeddings=SEQUENCE, attn_implementation="sdpa")  # fmt: skip
    with epl.split(2) if layout == "split(2)" else nullcontext():
        model = LlamaForCausalLM(llama)
    engine = epl.parallelize(model, optimizer=lambda p: torch.optim.Adam(p, lr=1e-4))
    rows = BATCH // engine.num_replicas
    tokens = torch.randint(0, VOCABULARY, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(1))
    mine = tokens[engine.replica_index * rows : (engine.replica_index + 1) * rows]
    batch = {"input_ids": mine, "labels": mine}
    seconds = median_step_seconds(lambda: engine.step(batch), steps)
    return {"seconds": seconds, "chosen": layout_of(engine.context.plan, engine.context.config, BATCH)}


@pytest.mark.timeout(1800)
def test_the_planned_layout_against_the_default_ones(tmp_path: Any) -> None:
    import json

    from epl.planner.calibrate import calibrate

    profile = tmp_path / "here.json"
    profile.write_text(json.dumps(calibrate(dtype="fp32", seconds=1.0, size=512).to_dict()))
    steps, rounds = (2, 1) if short_mode() else (5, 3)
    measured: dict[str, float] = {}
    chosen: Any = None  # the Layout the planner chose
    for _ in range(rounds):
        for layout in ("planned", "data parallel", "split(2)"):
            first = run_ranks(time_layout, 2, layout, str(profile), steps, timeout=600)[0]
            measured[layout] = min(measured.get(layout, float("inf")), first["seconds"])
            if layout == "planned":
                chosen = first["chosen"]
    default = min(measured["data parallel"], measured["split(2)"])
    details = [f"{name}: {ms(seconds * 1e3)} a step" for name, seconds in measured.items()]
    details.append(f"the planner chose {chosen}")
    row = ResultRow(
        'Planned layout (`auto.auto_parallel: "plan"`), 2 processes', "the faster of data parallel and split(2)",
        time=(Ratio(measured["planned"] / default),), plot="planned layout vs the default ones",
    )  # fmt: skip
    record("planner_auto", [row], section=SECTION, details=details)
    print("\n" + "\n".join(details))
    if not short_mode():
        assert measured["planned"] <= 1.10 * default, details
