"""``auto.auto_parallel: "plan"``: an unannotated script gets the planner's best layout at ``epl.parallelize``, and
trains as the same script in one process; the layouts ``epl plan --auto`` prints are configs EPL accepts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from epl.cli import make_cli
from epl.config import Config
from epl.errors import EplError
from epl.planner import PROFILES, Layout, ModelShape, Workload, search
from tests.helpers.distributed import run_ranks

SCRIPT = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import epl

epl.init(epl.Config({"auto.auto_parallel": "plan", "planner.global_batch_size": 64, "planner.sequence_length": 8192,
                     "planner.device": "h100-sxm"}))
config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256)
with torch.device("meta"):
    model = LlamaForCausalLM(config)
epl.parallelize(model, optimizer=lambda p: torch.optim.AdamW(p))
"""
LLAMA_8B = ModelShape(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256)
#: A CPU-like device for the training run.
CPU = {"name": "cpu", "flops": {"fp32": 1e11}, "memory_bytes": 2**33, "intra_node_bandwidth": 1e12,
       "inter_node_bandwidth": 1e12, "memory_bandwidth": 1e10}  # fmt: skip
STEPS, SEQUENCE = 2, 16


def test_an_unannotated_script_is_planned_as_epl_plan_auto_would(tmp_path: Path) -> None:
    script = tmp_path / "llama8b.py"
    script.write_text(SCRIPT)
    options = ["plan", "-n", "64", "--gpu-per-worker", "8", "--device", "h100-sxm", "--global-batch-size", "64",
               "--sequence-length", "8192", "--json", str(script)]  # fmt: skip
    result = CliRunner().invoke(make_cli(), options)
    assert result.exit_code == 0, result.output
    planned = json.loads(result.output)["layout"]
    best = search(LLAMA_8B, Workload(64, 8192, dtype="fp32"), PROFILES["h100-sxm"], 64).plans[0].layout
    assert planned == best.to_dict()


@pytest.mark.parametrize(
    "layout",
    [
        Layout(2, 2, 1, 1, 4),
        Layout(1, 1, 4, 8, 1, "none", "full", "GPipe"),
        Layout(2, 1, 2, 4, 1, "v1", "none", "interleaved", 2),
        Layout(1, 2, 2, 4, 1, "none", "none", "ZeroBubble"),
        Layout(2, 2, 1, 1, 4, sequence_parallel=True),
        Layout(1, 2, 1, 1, 1, gradient_checkpoint="auto"),
    ],
)
def test_the_config_of_a_layout_is_one_epl_accepts(layout: Layout) -> None:
    config = Config(layout.config())
    assert config["pipeline.num_stages"] in (None, layout.pipeline * layout.virtual_stages)
    # the planner's full recomputation is EPL's "auto" (each block from its input), its selective EPL's "selective"
    expected = {"none": "", "full": "auto", "auto": "selective"}[layout.gradient_checkpoint]
    assert config["gradient_checkpoint.type"] == expected
    assert config["split.sequence_parallel"] == layout.sequence_parallel


def test_layouts_epl_cannot_run_have_no_config() -> None:
    with pytest.raises(EplError, match="uneven stages"):
        Layout(1, 1, 2, 2, 1, stage_layers=(1, 3)).config()


def train(profile: str, planned: bool, batch: int) -> dict[str, Any]:
    """One rank: a tiny float64 Llama, unannotated, trained STEPS steps under the planned layout (or alone)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import epl

    config = {"planner.global_batch_size": batch, "planner.sequence_length": SEQUENCE, "planner.device": profile}
    epl.init(epl.Config({**config, "auto.auto_parallel": "plan"} if planned else {}))
    torch.manual_seed(0)
    llama = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=64, max_position_embeddings=SEQUENCE)  # fmt: skip
    model = LlamaForCausalLM(llama).double()
    engine = epl.parallelize(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    tokens = torch.randint(0, 64, (batch, SEQUENCE), generator=torch.Generator().manual_seed(1))
    rows = batch // engine.num_replicas
    mine = tokens[engine.replica_index * rows : (engine.replica_index + 1) * rows]
    losses = [float(engine.step({"input_ids": mine, "labels": mine})) for _ in range(STEPS)]
    context = engine.context
    return {"losses": losses, "config": {k: context.config[k] for k in ("pipeline.num_stages", "zero.level")},
            "tensor": max((tg.device_count for tg in context.plan.taskgraphs), default=1),
            "context": context.plan.context_degree}  # fmt: skip


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("batch", "sharing"), [(4, 1), (1, 2)])
def test_a_planned_layout_trains_as_one_process(tmp_path: Path, batch: int, sharing: int) -> None:
    """4 sequences: the planner replicates (ZeRO v0 on this profile); 1 sequence cannot be divided among
    replicas, so the 2 devices share it: split(2) or context parallelism, whichever is predicted faster."""
    profile = tmp_path / "cpu.json"
    profile.write_text(json.dumps(CPU))
    alone = run_ranks(train, 1, str(profile), False, batch, timeout=240)[0]
    ranks = run_ranks(train, 2, str(profile), True, batch, timeout=240)
    assert ranks[0]["tensor"] * ranks[0]["context"] == sharing
    replicas = 2 // sharing  # each replica's loss is its rows' mean: the batch's is their mean
    for step in range(STEPS):
        mean = sum(rank["losses"][step] for rank in ranks) / len(ranks)
        assert mean == pytest.approx(alone["losses"][step], rel=1e-6), (replicas, ranks, alone)


def test_a_plan_needs_the_job_and_an_unannotated_model() -> None:
    from epl.planner.apply import choose_layout, split_taskgraphs

    config = Config({"auto.auto_parallel": "plan", "planner.device": "h100-sxm"})
    with pytest.raises(EplError, match="planner.global_batch_size"):
        choose_layout(object(), config, 8, 8)  # type: ignore[arg-type]
    from epl.annotations.strategies import split
    from epl.annotations.taskgraph import TaskGraph

    with pytest.raises(EplError, match="unannotated models"):
        split_taskgraphs([TaskGraph(0, split(2))], Layout(1, 2, 1, 1, 1))
