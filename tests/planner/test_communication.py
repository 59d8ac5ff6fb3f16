"""The planner's payload bytes per step against the collectives EPL issues, counted with the profiler, on 2
processes: data parallel, ZeRO v0-v2, split(2) and 2 pipeline stages of a transformers Llama (float32) trained on
its own loss, and split(2) x 2 stages (3D) on 4.

Equal to the byte, each kind, and so are the calls. Under split, the head's logits are all-gathered once per
micro-batch because the model computes its own loss on whole logits (``Workload.gathered_logits``; a ``loss_fn`` on
logits runs the parallel cross-entropy instead, with no gather). What else is sent is small and named here:

- pipeline: the rotary position embeddings (cos and sin, ``s x head_dim`` each) sent with the activations, and the
  loss, all-reduced once so that every stage returns it.

ZeRO (v0-v2, FSDP2 per block) reduce-scatters each block's gradients in every micro-batch's backward (v0 once, in the
last, its gradients accumulated whole) and all-gathers
its weights for every micro-batch's forward (v0, v1) and again for its backward (v2): the decoder layers, and the
embedding, the final norm and the head, each a block of its own.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.multiprocess

BATCH, SEQUENCE, MICRO = 4, 16, 2
CASES = {
    "data parallel": ({}, 1),
    "split(2)": ({}, 2),
    "2 stages": ({"pipeline.num_stages": 2, "auto.auto_parallel": True}, 1),
    "ZeRO v0": ({"zero.level": "v0"}, 1),
    "ZeRO v1": ({"zero.level": "v1"}, 1),
    "ZeRO v2": ({"zero.level": "v2"}, 1),
    "3D": ({"pipeline.num_stages": 2, "auto.auto_parallel": True}, 2),  # split(2) x 2 stages: 4 processes
}  # the ZeRO levels as EPL runs them (FSDP2): each block's gradients reduce-scattered, its weights all-gathered


def count(name: str) -> dict[str, Any]:
    """One rank: the case's step, its collectives counted, and the planner's prediction for the layout."""
    from contextlib import nullcontext

    import torch
    from benchmarks.collectives import collectives_of, less_batch_check
    from transformers import LlamaConfig, LlamaForCausalLM

    import epl
    from epl.planner import ModelShape, Workload
    from epl.planner.communication import collective_calls, payload_bytes
    from epl.planner.from_plan import layout_of

    config, split = CASES[name]
    epl.init(epl.Config({"pipeline.num_micro_batch": MICRO, "io.check_batches": False, **config}))
    torch.manual_seed(0)
    llama = LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=128, max_position_embeddings=SEQUENCE)  # fmt: skip
    with epl.split(split) if split > 1 else nullcontext():
        model = LlamaForCausalLM(llama)
    engine = epl.parallelize(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    tokens = torch.randint(0, 128, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(1))
    engine.step({"input_ids": tokens, "labels": tokens})  # the first step sets things up
    counted = collectives_of(lambda: engine.step({"input_ids": tokens, "labels": tokens}))
    counts, _ = less_batch_check(counted.counts)
    layout = layout_of(engine.context.plan, engine.context.config, BATCH * engine.num_replicas)
    shape = ModelShape.of(model)
    workload = Workload(BATCH * engine.num_replicas, SEQUENCE, "fp32", gathered_logits=True)  # the model's own loss
    predicted = payload_bytes(shape, layout, workload)
    return {"counts": counts, "bytes": counted.bytes, "predicted": predicted,
            "calls": collective_calls(shape, layout, workload)}  # fmt: skip


def counts_of(names: list[str]) -> dict[str, dict[str, Any]]:
    return {name: count(name) for name in names}


@pytest.fixture(scope="module")
def counted() -> list[dict[str, dict[str, Any]]]:
    return run_ranks(counts_of, 2, [name for name in CASES if name != "3D"], timeout=300)


def payload(counts: dict[str, int], *operations: str) -> int:
    """Bytes (float32) of the counted collectives of ``operations`` whose tensor is an activation [b, s, h]."""
    total = 0
    for key, times in counts.items():
        operation, _, shape = key.partition(" ")
        dims = [int(n) for n in shape.strip("[]").split(",") if n.strip()]
        if operation in operations and dims == [BATCH // MICRO, SEQUENCE, 64]:
            total += times * 4 * BATCH // MICRO * SEQUENCE * 64
    return total


@pytest.mark.timeout(400)
def test_payloads_are_the_predicted_ones(counted: list[dict[str, dict[str, Any]]]) -> None:
    for ranks in counted:
        data, split, stages = ranks["data parallel"], ranks["split(2)"], ranks["2 stages"]
        buckets = sum(n * 4 * int(k.split("[")[1].rstrip("]")) for k, n in data["counts"].items())
        assert set(k.split(" ")[0] for k in data["counts"]) == {"allreduce"}, data["counts"]
        assert buckets == data["predicted"]["data_parallel"], data
        assert payload(split["counts"], "allreduce") == split["predicted"]["tensor_parallel"], split
        others = {k: n for k, n in split["counts"].items() if not k.startswith("allreduce")}
        assert list(others.values()) == [MICRO] and all("allgather" in k for k in others), others  # the logits
        # the profiler records the gathered tensor's first dimension only: the vocabulary (the logits go vocabulary
        # first), gathered whole from each device's half, for BATCH // MICRO x SEQUENCE tokens a micro-batch
        assert all(k.endswith("[128]") for k in others), others
        share = MICRO * (BATCH // MICRO) * SEQUENCE * 128 // 2 * 4
        assert split["predicted"]["gathered_logits"] == share, split["predicted"]
        moved = payload(stages["counts"], "send", "recv")
        assert moved == stages["predicted"]["pipeline"], stages
        rotary = {k: n for k, n in stages["counts"].items() if k.startswith("send [1,")}
        assert sum(rotary.values()) in (0, 2 * MICRO), stages["counts"]  # the last stage sends none


@pytest.mark.timeout(400)
def test_zero_payloads_are_the_predicted_ones(counted: list[dict[str, dict[str, Any]]]) -> None:
    for ranks in counted:
        for level in ("v0", "v1", "v2"):
            zero = ranks[f"ZeRO {level}"]
            assert zero_payloads(zero["counts"]) == (
                zero["predicted"]["data_parallel"],
                zero["predicted"]["zero_parameters"],
            ), (level, zero)


def zero_payloads(counts: dict[str, int]) -> tuple[int, int]:
    """Bytes (float32) of ZeRO's reduce-scatters and all-gathers: the whole gradients each reduce-scatter is given
    (the profiler records its first tensor, the output: this rank's chunk of 2), and each all-gather's whole
    weights (its output). Nothing else is sent (the batch check's and the non-finite check's numbers aside)."""
    kinds = {"_reduce_scatter_base": 0, "_allgather_base": 0}
    for key, times in counts.items():
        operation, _, shape = key.partition(" ")
        kinds[operation] += times * 4 * int(shape.strip("[]"))
    return 2 * kinds["_reduce_scatter_base"], kinds["_allgather_base"]


def calls(counts: dict[str, int], *operations: str, activations: bool = False) -> int:
    """How many of the counted collectives are of ``operations`` (of an activation's shape only, if asked)."""
    total = 0
    for key, times in counts.items():
        operation, _, shape = key.partition(" ")
        dims = [int(n) for n in shape.strip("[]").split(",") if n.strip()]
        if operation in operations and (not activations or dims == [BATCH // MICRO, SEQUENCE, 64]):
            total += times
    return total


@pytest.mark.timeout(400)
def test_collective_calls_are_the_predicted_ones(counted: list[dict[str, dict[str, Any]]]) -> None:
    for ranks in counted:
        data, split, stages = ranks["data parallel"], ranks["split(2)"], ranks["2 stages"]
        assert calls(data["counts"], "allreduce") == data["calls"]["data_parallel"], data
        assert calls(split["counts"], "allreduce", activations=True) == split["calls"]["tensor_parallel"], split
        assert calls(split["counts"], "_allgather_base") == split["calls"]["gathered_logits"], split
        assert calls(stages["counts"], "send", "recv", activations=True) == stages["calls"]["pipeline"], stages


@pytest.mark.timeout(400)
def test_zero_collective_calls_are_the_predicted_ones(counted: list[dict[str, dict[str, Any]]]) -> None:
    for ranks in counted:
        for level in ("v0", "v1", "v2"):
            zero = ranks[f"ZeRO {level}"]
            assert calls(zero["counts"], "_reduce_scatter_base") == zero["calls"]["data_parallel"], (level, zero)
            assert calls(zero["counts"], "_allgather_base") == zero["calls"]["zero_parameters"], (level, zero)


@pytest.mark.timeout(400)
def test_3d_payloads_and_calls_are_the_predicted_ones() -> None:
    """split(2) x 2 stages on 4 processes: each rank's activation all-reduces (4 per block and micro-batch, and the
    embedding's or the head's), and the whole activations each tensor device sends to its peer in the next stage
    (EPL sends them whole, where Megatron scatters them over the tensor devices); the last stage gathers the
    logits."""
    for rank, counts in enumerate(run_ranks(counts_of, 4, ["3D"], timeout=300)):
        found = counts["3D"]
        assert payload(found["counts"], "allreduce") == found["predicted"]["tensor_parallel"], (rank, found)
        assert calls(found["counts"], "allreduce", activations=True) == found["calls"]["tensor_parallel"], found
        assert payload(found["counts"], "send", "recv") == found["predicted"]["pipeline"], (rank, found)
        assert calls(found["counts"], "send", "recv", activations=True) == found["calls"]["pipeline"], found
        last_stage = rank >= 2
        gathered = calls(found["counts"], "_allgather_base")
        assert gathered == (found["calls"]["gathered_logits"] if last_stage else 0), (rank, found)
