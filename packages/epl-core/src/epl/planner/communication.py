"""The payload bytes one device hands to collectives in a step, by kind, as EPL runs a layout.

Payload is what a collective is given (an all-reduce's tensor, a point-to-point message), not what the wire
carries: ``estimate`` turns payloads into time with each algorithm's factor. Per step, on a device of the first
pipeline stage:

- **tensor parallel** (``split``): per block and micro-batch, two all-reduces of the activations forward (after
  the attention's and the MLP's row-parallel projections) and two backward (before their column-parallel
  inputs); per micro-batch one more for the vocabulary-parallel embedding's output, and one for the gradient of
  the head's input (Megatron's pairing: 4 per block + 2, asserted in benchmarks/test_split_llama.py); full
  recomputation repeats a block's two forward all-reduces. Under sequence parallelism (``split.sequence_parallel``)
  each all-reduce is an all-gather and a reduce-scatter (each half its bytes), the backward pass gathers each
  region's saved input again (2 all-gathers per block: one all-reduce's bytes, not under full recomputation), and
  the cut and the final gather add an all-gather each per micro-batch; payloads are counted in all-reduces;
- **gathered logits** (``Workload.gathered_logits``): per micro-batch, the device's share of the head's output,
  all-gathered when the model computes its own loss on whole logits;
- **pipeline**: per micro-batch, the activations sent forward and their gradient received back across each
  boundary the device sits on; under split each tensor device sends the whole activation to its peer (Megatron
  scatters it over them), under sequence parallelism its share of the tokens;
- **data parallel**: the gradients of the weights the device holds (its shards, and the norms whole), all-reduced
  once per step; under ZeRO (v0-v2: every tensor chunked over the data devices by FSDP2, ``epl_memory.zero``) each
  block's gradients are reduce-scattered as its backward ends, in every micro-batch (the whole gradients are the
  payload; :func:`zero_collectives`);
- **ZeRO's weights** (``zero_parameters``): each block's weights all-gathered from their chunks (the whole weights
  are the payload) before each micro-batch's forward under v0 and v1 (kept whole until its backward ends), and
  before its forward and again before its backward under v2.

:func:`collective_calls` counts the calls, each of which costs the device profile's latency besides its bytes.

Left out, and small: the parallel cross-entropy's all-reduces of a max and a sum per token, and a norm's
gradient summed over a shard group.
"""

from __future__ import annotations

import math

from epl.planner.layout import Layout, Workload
from epl.planner.shape import ModelShape


def stage_blocks(shape: ModelShape, layout: Layout, stage: int | None = None) -> int:
    """Blocks pipeline ``stage`` holds: ``Layout.stage_layers``'s count, or ``ceil(L/p)`` (the automatic
    partition's most loaded stage); ``stage`` None: the most of any stage."""
    if layout.stage_layers:
        return max(layout.stage_layers) if stage is None else layout.stage_layers[stage]
    return math.ceil(shape.layers / layout.pipeline)


def stages_to_check(layout: Layout) -> tuple[int, ...]:
    """The stages whose peak may be the highest: every stage of uneven ``stage_layers``, else the first (the
    embedding, the most micro-batches in flight) and the last (the head and the logits)."""
    p = layout.pipeline
    if layout.stage_layers:
        return tuple(range(p))
    return (0,) if p == 1 else (0, p - 1)


def weights_per_device(shape: ModelShape, layout: Layout, stage: int | None = None) -> float:
    """Weights one device of pipeline ``stage`` holds: its blocks (:func:`stage_blocks`) and the embedding on the
    first stage or the head on the last, divided over the tensor devices, the norms whole; ``stage`` None: the most
    loaded, a stage of the most blocks with the embedding."""
    p = layout.pipeline
    blocks = stage_blocks(shape, layout, stage)
    ends = 1 if stage is None or p == 1 else (stage == 0) + (stage == p - 1)
    embedding = shape.vocab * shape.hidden * (2 if p == 1 and not shape.tied else ends)
    norms = 2 * shape.hidden * blocks + (shape.hidden if stage == p - 1 or p == 1 else 0)
    return (blocks * (shape.layer_parameters() - 2 * shape.hidden) + embedding) / layout.tensor + norms


def largest_unit(shape: ModelShape, layout: Layout) -> float:
    """Weights on one device of the largest block ZeRO gathers at once (:func:`zero_units`): a decoder layer, or
    the embedding or the head, divided over the tensor devices (a layer's norms whole); not the embedding and
    head where the root holds them (:func:`zero_root_holds_ends`)."""
    layer = (shape.layer_parameters() - 2 * shape.hidden) / layout.tensor + 2 * shape.hidden
    return layer if zero_root_holds_ends(layout) else max(layer, shape.vocab * shape.hidden / layout.tensor)


def zero_root_holds_ends(layout: Layout) -> bool:
    """Whether ZeRO leaves the embedding, the final norm and the head to the model's root unit, reduced as the
    backward ends (``epl_memory.blocks.find_units`` without ``loose``): v0 and v1 on one stage."""
    return layout.zero in ("v0", "v1") and layout.pipeline == 1


def root_unit(shape: ModelShape, layout: Layout) -> float:
    """Weights on one device of the root unit under :func:`zero_root_holds_ends`: the embedding, the final norm and
    the head (one matrix when tied)."""
    return shape.vocab * shape.hidden / layout.tensor * (1 if shape.tied else 2) + shape.hidden


def stage_root_weights(shape: ModelShape, layout: Layout, stage: int) -> float:
    """Weights on one device of pipeline ``stage``'s root unit, outside its blocks: on one stage
    :func:`root_unit`; else the embedding on the first stage, the final norm and the head on the last, none
    between."""
    p = layout.pipeline
    if p == 1:
        return root_unit(shape, layout)
    last = stage == p - 1
    return shape.vocab * shape.hidden / layout.tensor * ((stage == 0) + last) + shape.hidden * last


def updated_weights(shape: ModelShape, layout: Layout, stage: int | None = None) -> float:
    """Weights one device's optimizer updates: those it holds (:func:`weights_per_device`), or under ZeRO (v0-v2)
    its share of them over the data devices."""
    weights = weights_per_device(shape, layout, stage)
    return weights / layout.data if layout.zero in ("v0", "v1", "v2") else weights


def payload_bytes(shape: ModelShape, layout: Layout, workload: Workload, grad_bytes: int = 4) -> dict[str, float]:
    """Bytes per step one device hands to tensor-parallel, pipeline and data-parallel collectives."""
    t, d = layout.tensor, layout.data
    tokens = layout.micro_batch_size * workload.sequence  # a micro-batch's
    message = tokens * shape.hidden * workload.dtype_bytes  # its activations, one tensor-parallel all-reduce's
    calls = collective_calls(shape, layout, workload)
    tensor = tensor_parallel_all_reduces(shape, layout) * message
    pipeline = calls["pipeline"] * message / (t if layout.sequence_parallel else 1)
    logits = calls["gathered_logits"] * tokens * shape.vocab / t * workload.dtype_bytes  # this device's share
    data = parameters = 0.0
    if d > 1:
        weights = weights_per_device(shape, layout)
        data = weights * grad_bytes
        if zero_shards(layout):
            reductions, gathers = zero_collectives(layout, workload)
            data *= reductions
            parameters = gathers * weights * workload.dtype_bytes
    return {
        "tensor_parallel": tensor, "gathered_logits": logits, "pipeline": pipeline, "data_parallel": data,
        "zero_parameters": parameters,
    }  # fmt: skip


#: A block's tensor-parallel all-reduces of one micro-batch by checkpointing: 2 forward and 2 backward; recomputing
#: the block repeats the forward's 2; torch's per-operation policy (``ops``) repeats the attention's, whose in-place
#: collective it recomputes rather than keeps (EPL's split: tests/memory/test_selective_checkpointing.py).
_TENSOR_ALL_REDUCES = {"none": 4, "auto": 4, "ops": 5, "full": 6}


def tensor_parallel_all_reduces(shape: ModelShape, layout: Layout) -> float:
    """A step's tensor-parallel traffic on one device, in all-reduces of one micro-batch's activations (an
    all-gather or a reduce-scatter counts half)."""
    if layout.tensor == 1:
        return 0.0
    blocks = stage_blocks(shape, layout)
    full = layout.gradient_checkpoint == "full"
    per_block = _TENSOR_ALL_REDUCES[layout.gradient_checkpoint]
    outside: float = 2 if layout.pipeline == 1 else 1  # the embedding on the first stage, the head's input on the last
    if layout.sequence_parallel:
        per_block += 0 if full else 1  # the saved inputs gathered again (2 all-gathers)
        outside += 1 if layout.pipeline == 1 else 0.5  # the cut's and the final gather's all-gathers
    return (per_block * blocks + outside) * layout.micro_batches


#: Gradient buckets per dtype (``communication.max_splits``'s default).
GRADIENT_BUCKETS = 5
#: The most bytes of gradients a bucket holds where :data:`GRADIENT_BUCKETS` would hold more
#: (``communication.bucket_size_mb``'s default).
BUCKET_BYTES = 25 * 2**20


def gradient_buckets(shape: ModelShape, layout: Layout) -> int:
    """Data parallelism's buckets on one device: :data:`GRADIENT_BUCKETS`, or as many as keep each within
    :data:`BUCKET_BYTES` of float32 gradients (``epl_comm.buckets``; a cut by bytes may add one or two more)."""
    return max(GRADIENT_BUCKETS, math.ceil(4 * weights_per_device(shape, layout) / BUCKET_BYTES))


def zero_shards(layout: Layout) -> bool:
    """Whether the layout chunks every tensor over its data devices (ZeRO v0-v2 on more than one)."""
    return layout.zero in ("v0", "v1", "v2") and layout.data > 1


def zero_collectives(layout: Layout, workload: Workload) -> tuple[int, int]:
    """How many times per step ZeRO reduce-scatters each block's gradients and gathers its weights. EPL (FSDP2)
    reduces in every micro-batch's backward (v0 on one stage: once, in the last; its gradients accumulate whole),
    and gathers for every micro-batch's forward under v0 and v1 (the
    weights stay whole until its backward ends: ``reshard_after_forward=False``) and again for its backward under v2.
    ``Workload.zero_once_per_step`` (Megatron-LM's distributed optimizer) reduces once a step and, under v0 and v1,
    gathers once a step; ``Workload.weights_gathered_once`` gathers once a step and still reduces in every
    micro-batch."""
    m = layout.micro_batches
    once = workload.zero_once_per_step
    gathered_once = once or workload.weights_gathered_once
    reduced_once = once or zero_accumulates_whole(layout)
    if zero_holds_whole_stage(layout):
        return 1, 1
    return (1 if reduced_once else m), (2 * m if layout.zero == "v2" else 1 if gathered_once else m)


def zero_accumulates_whole(layout: Layout) -> bool:
    """Whether ZeRO keeps each block's gradient whole over a step's micro-batches and reduces it once: v0 on one
    stage (``epl_memory.zero``; a pipeline's runner reduces in every micro-batch), and every level under a
    zero-bubble schedule (:func:`zero_holds_whole_stage`)."""
    return (layout.zero == "v0" and layout.pipeline == 1 and layout.micro_batches > 1) or zero_holds_whole_stage(layout)


def zero_holds_whole_stage(layout: Layout) -> bool:
    """Whether ZeRO keeps the stage's weights gathered and its gradients whole through a step, gathering and
    reducing once: under a zero-bubble schedule, whose weight gradients come after the input gradients
    (``epl_memory.step_end_reduction``)."""
    return layout.zero in ("v0", "v1", "v2") and layout.schedule == "ZeroBubble"


def zero_units(shape: ModelShape, layout: Layout) -> int:
    """Blocks ZeRO gathers and reduces one at a time on a device of the first (or last) stage: its decoder layers,
    and (``epl_memory.blocks.find_units``) under v2 the embedding, the final norm and the head, each a unit of its
    own (a tied embedding and head are one matrix, gathered with the model's root); under v0 and v1 on one stage
    the root, which holds them (:func:`zero_root_holds_ends`)."""
    blocks = stage_blocks(shape, layout)
    if zero_root_holds_ends(layout):
        return blocks + 1
    return blocks + ((2 if shape.tied else 3) if layout.pipeline == 1 else 1)


def collective_calls(shape: ModelShape, layout: Layout, workload: Workload) -> dict[str, float]:
    """Collective calls per step one device makes, by the kinds of :func:`payload_bytes`: each tensor-parallel
    all-reduce; a send and a receive per micro-batch and boundary; :func:`gradient_buckets` gradient buckets, or
    under ZeRO a reduce-scatter per block (:func:`zero_units`) and micro-batch; ZeRO's all-gathers, one per block
    and micro-batch under v0 and v1, two under v2."""
    t, p, d, m = layout.tensor, layout.pipeline, layout.data, layout.micro_batches
    blocks = stage_blocks(shape, layout)
    tensor = 0.0
    if t > 1:
        per_block = _TENSOR_ALL_REDUCES[layout.gradient_checkpoint]
        outside = 2 if p == 1 else 1  # the embedding on the first stage, the head last
        if layout.sequence_parallel:  # each all-reduce two calls, the regathers 2, the cut and the final gather
            per_block = 2 * per_block + (0 if layout.gradient_checkpoint == "full" else 2)
            outside += 2 if p == 1 else 1
        tensor = (per_block * blocks + outside) * m
    pipeline = 2.0 * m if p > 1 else 0.0
    logits = float(m) if t > 1 and workload.gathered_logits else 0.0
    data = parameters = 0.0
    if zero_shards(layout):
        reductions, gathers = zero_collectives(layout, workload)
        data, parameters = float(reductions * zero_units(shape, layout)), float(gathers * zero_units(shape, layout))
    elif d > 1:
        data = float(gradient_buckets(shape, layout))
    return {
        "tensor_parallel": tensor, "gathered_logits": logits, "pipeline": pipeline, "data_parallel": data,
        "zero_parameters": parameters,
    }  # fmt: skip
