"""The planner's estimates: the JSON keys of the contract, memory under ZeRO, fitting, and the search's speed."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from epl.errors import EplError
from epl.planner import PROFILES, Layout, ModelShape, Workload, device_profile, estimate, search

LLAMA_8B = ModelShape(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256)
LLAMA_70B = ModelShape(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256)


def test_a_shape_counts_llama_3_8b_parameters() -> None:
    assert LLAMA_8B.parameters == pytest.approx(8.03e9, rel=0.01)
    assert LLAMA_70B.parameters == pytest.approx(70.6e9, rel=0.01)


def test_an_estimate_has_the_contract_keys() -> None:
    layout = Layout(data=8, tensor=8, pipeline=1, micro_batches=1, micro_batch_size=1, zero="v1")
    result = estimate(LLAMA_8B, layout, Workload(global_batch=8, sequence=8192), PROFILES["h100-sxm"]).to_dict()
    assert set(result["layout"]) == {
        "data", "tensor", "pipeline", "micro_batches", "micro_batch_size", "zero", "gradient_checkpoint", "schedule"
    }  # fmt: skip
    memory = result["memory_per_device"]
    assert set(memory) == {"parameters", "gradients", "optimizer", "activations", "peak", "peak_stage", "peak_moment",
                           "peak_terms"}  # fmt: skip
    assert sum(memory["peak_terms"].values()) == pytest.approx(memory["peak"], abs=len(memory["peak_terms"]))
    assert {"step_time_s", "tokens_per_second", "mfu", "fits"} <= set(result)
    assert 0 < result["mfu"] < 1 and result["fits"] is True


def test_the_printed_terms_add_up_to_the_peak_in_every_searched_layout() -> None:
    """Every byte of the peak is a named term, at whichever stage and moment the peak is: the terms the text prints
    and ``--json``'s ``peak_terms`` add up to ``peak``."""
    from epl.planner.render import describe

    work, device = Workload(global_batch=64, sequence=4096), PROFILES["h100-sxm"]
    for plan in search(LLAMA_8B, work, device, 32).plans[::97]:
        assert sum(plan.memory.terms.values()) == pytest.approx(plan.peak)
        assert plan.memory.terms["parameters"] == plan.parameters
        text = describe(plan, device)
        assert all(name.replace("_", " ") in text for name in plan.memory.terms)


def test_uneven_stages_are_each_evaluated() -> None:
    """Llama 3's first and last stages hold one block fewer: the peak is that of the stage that holds the most."""
    work, device = Workload(global_batch=64, sequence=4096), PROFILES["h100-sxm"]
    even = Layout(1, 1, 4, 64, 1)
    uneven = replace(even, stage_layers=(7, 9, 9, 7))
    assert estimate(LLAMA_8B, uneven, work, device).peak < estimate(LLAMA_8B, replace(even, stage_layers=(9, 7, 7, 9)),
                                                                    work, device).peak  # fmt: skip
    with pytest.raises(EplError, match="stage_layers"):
        Layout(1, 1, 4, 64, 1, stage_layers=(8, 8))


def test_zero_levels_chunk_every_tensor_and_differ_in_the_step() -> None:
    """ZeRO runs on FSDP2 (epl_memory.zero): every level keeps a chunk of each weight, gradient and state between
    steps (v0 is v1: FSDP2 has no mode sharding only the states; the levels once sharded states, then gradients,
    then weights). They differ inside the step: v0 and v1 hold every block's weights whole from its forward to its
    backward, v2 one block's at a time; over micro-batches v0 accumulates every gradient whole (float32)."""
    work, device = Workload(global_batch=64, sequence=2048), PROFILES["a100-80gb"]
    held = {
        zero: estimate(LLAMA_8B, Layout(8, 1, 1, 8, 1, zero=zero), work, device)  # type: ignore[arg-type]
        for zero in ("none", "v0", "v1", "v2")
    }
    for level in ("v0", "v1", "v2"):
        assert held[level].optimizer == pytest.approx(held["none"].optimizer / 8)
        assert held[level].gradients == pytest.approx(held["none"].gradients / 8)
        # bf16 training: each chunk is the float32 master (4 bytes), where a replica holds 2 + 4 a weight
        assert held[level].parameters == pytest.approx(held["none"].parameters * 4 / 6 / 8)
    # after the first micro-batch v0 holds every gradient whole where v1 holds its chunk (v0's chunks come from the
    # last micro-batch's reduction)
    assert held["v0"].peak - held["v1"].peak == pytest.approx(LLAMA_8B.parameters * 4 * (1 - 1 / 8), rel=0.01)
    # v1 holds every bf16 weight whole at the start of backward, v2 the largest block's (the embedding or head); and
    # each reduces its largest unit's gradient twice then: v1 a layer's (the root holds the embedding and head, reduced
    # as the backward ends), v2 the head's
    embedding, layer = 128256 * 4096, LLAMA_8B.layer_parameters()
    expected = (LLAMA_8B.parameters - embedding) * 2 + 2 * (layer - embedding) * 4
    assert held["v1"].peak - held["v2"].peak == pytest.approx(expected, rel=0.01)
    assert not held["none"].fits and held["v2"].fits  # 8B with Adam replicated needs ~130 GiB


def test_checkpointing_trades_activations_for_time() -> None:
    work, device = Workload(global_batch=8, sequence=8192), PROFILES["h100-sxm"]
    plain = estimate(LLAMA_8B, Layout(8, 1, 1, 1, 1, zero="v2"), work, device)
    full = estimate(LLAMA_8B, Layout(8, 1, 1, 1, 1, zero="v2", gradient_checkpoint="full"), work, device)
    assert full.activations < plain.activations / 4  # what remains is mostly the float32 logits
    assert full.step_time_s > plain.step_time_s


@pytest.mark.parametrize(("devices", "limit"), [(1024, 5.0), (16384, 60.0)])
def test_the_search_is_fast_and_its_best_plan_fits(devices: int, limit: float) -> None:
    start = time.perf_counter()
    result = search(LLAMA_70B, Workload(global_batch=2048, sequence=4096), PROFILES["h100-sxm"], devices)
    assert time.perf_counter() - start < limit
    assert result.searched > 50 and result.plans[0].fits
    assert result.plans[0].step_time_s == min(p.step_time_s for p in result.plans if p.fits)


def test_a_device_profile_comes_by_name_or_from_a_file(tmp_path) -> None:
    path = tmp_path / "mine.json"
    path.write_text('{"base": "h100-sxm", "efficiency": 0.42}')
    assert device_profile(str(path)).efficiency == 0.42
    assert device_profile("b200").peak("bf16") > device_profile("h200").peak("bf16")
    with pytest.raises(EplError, match="Unknown device 'h300'.*h100-sxm"):
        device_profile("h300")


def test_a_mixture_of_experts_is_refused_not_mis_sized() -> None:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, vocab_size=64)  # fmt: skip
    with torch.device("meta"):
        model = MixtralForCausalLM(config)
    with pytest.raises(EplError, match="routes tokens to 4 experts"):
        ModelShape.of(model)


def test_context_parallelism_divides_a_devices_activations_and_adds_the_ring() -> None:
    """Llama 3 8B at 128K tokens with full recomputation: one sequence does not fit an H100, and does over 8
    context devices, each holding 16K tokens; the ring's time is a part of the step."""
    work, device = Workload(global_batch=1, sequence=131072), PROFILES["h100-sxm"]
    alone = estimate(LLAMA_8B, Layout(1, 1, 1, 1, 1, gradient_checkpoint="full"), work, device)
    spread = estimate(LLAMA_8B, Layout(1, 1, 1, 1, 1, zero="v2", gradient_checkpoint="full", context=8), work, device)
    assert spread.layout.devices == 8
    assert spread.layout.config() == {"zero.level": "v2", "gradient_checkpoint.type": "auto", "context.degree": 8}
    assert spread.activations < alone.activations / 7
    assert not alone.fits and spread.fits
    assert spread.time_parts["context_parallel"] > 0
    assert spread.to_dict()["layout"]["context"] == 8


def test_the_search_spreads_a_long_sequence_when_nothing_else_fits() -> None:
    best = search(LLAMA_8B, Workload(global_batch=1, sequence=131072), PROFILES["h100-sxm"], 8).plans[0]
    assert best.fits and best.layout.context > 1


def test_the_search_composes_context_with_tensor_and_pipeline_parallelism() -> None:
    """Llama 3 8B at 128K tokens on 32 devices: layouts with context, tensor and pipeline parallelism together are
    searched, and their config names all three; a lane of t x p devices spreads the ring over nodes once c lanes
    no longer fit one."""
    work, device = Workload(global_batch=4, sequence=131072), PROFILES["h100-sxm"]
    result = search(LLAMA_8B, work, device, 32)
    composed = [plan for plan in result.plans if plan.layout.context > 1 and plan.layout.tensor > 1]
    assert any(plan.layout.pipeline > 1 and plan.fits for plan in composed)
    layout = Layout(1, 2, 2, 4, 1, gradient_checkpoint="full", sequence_parallel=True, context=2)
    config = layout.config()
    assert config["context.degree"] == 2 and config["pipeline.num_stages"] == 2 and config["split.sequence_parallel"]
    in_node = estimate(LLAMA_8B, layout, work, device).time_parts["context_parallel"]
    across = estimate(LLAMA_8B, replace(layout, tensor=4), work, device).time_parts["context_parallel"]
    assert across > in_node
