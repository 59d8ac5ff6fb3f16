"""One layout's predicted memory per device, step time and its parts, tokens/s and MFU.

**Memory**: :mod:`epl.planner.memory`, the peak of the most loaded device as named terms that add up to it.

**Time.** Model FLOPs are PaLM's (Chowdhery et al. 2022, appendix B): ``6·N + 12·L·h·s`` per token, N the
weights of the blocks and the head, recomputation not counted; MFU is model FLOPs per second over the devices'
peak. The hardware also runs the recomputation: a block's forward again under ``full`` checkpointing, the
attention core's under ``auto``. Parts of a step, on one device:

- compute: the hardware FLOPs of the slowest device (a stage of ``ceil(L/p)`` blocks and the head, the last
  stage's, over the tensor devices) / (peak x the profile's efficiency);
- memory-bound: the bytes of :mod:`epl.planner.memory_traffic` (elementwise kernels, the loss, the optimizer's
  update) over the device's memory bandwidth;
- host overhead: the profile's host time per block and per micro-batch (on a CPU; about none on a GPU), times the
  device's blocks (a third more under full recomputation) and micro-batches;
- tensor parallel: the activation all-reduces of :func:`epl.planner.communication.payload_bytes` (4 per block and
  micro-batch, 6 under ``full`` checkpointing, and the embedding's and head's), ``2(t-1)/t`` of the bytes each,
  not overlapped (as Megatron without overlap); and the head's logits all-gathered per micro-batch when the model
  computes its own loss on them (``Workload.gathered_logits``);
- pipeline: a micro-batch's activations forward and their gradient back per stage boundary and micro-batch;
- data parallel: float32 gradients, ``2(d-1)/d`` of their bytes once a step; under ZeRO each block's
  reduce-scattered in every micro-batch (``(d-1)/d`` of the bytes, half an all-reduce's latency), and its weights
  all-gathered (``(d-1)/d``) for every micro-batch's forward under v0 and v1 and again for its backward under v2
  (:mod:`epl.planner.communication`); the gradients' reduction overlaps (the profile's ``overlap`` of it) with the
  backward of the last micro-batch, ZeRO's weights are waited for; with ``Workload.weights_prefetched`` (FSDP on a
  GPU, which gathers the next block's weights during this one's compute) all of it runs behind the step's
  compute;
- each collective call also costs the profile's latency (:func:`epl.planner.communication.collective_calls`),
  measured on an all-reduce, which exchanges two messages on the way (a reduce-scatter and an all-gather); a
  broadcast or a send, one message, costs half of it;
- bubble: ``(p-1)`` micro-batch times under GPipe, 1F1B and ZeroBubble, divided by the virtual stages under
  interleaved 1F1B. ZB-H1 (Qi et al. 2023) cuts the bubble to a third in theory; EPL's measured bubble is 1.5x
  1F1B's on 2 stages and 0.87x on 4 (benchmarks/test_pipeline.py, CPU), so the planner credits ZeroBubble no
  gain until a GPU run shows one.

Tensor groups sit inside a node; data and pipeline groups cross nodes once ``t·d`` passes the node's devices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from epl.planner import memory_traffic
from epl.planner.communication import (
    collective_calls,
    payload_bytes,
    stage_blocks,
    updated_weights,
    weights_per_device,
    zero_collectives,
    zero_shards,
)
from epl.planner.devices import DeviceProfile
from epl.planner.layout import Layout, Workload
from epl.planner.memory import MemoryBreakdown, context_as_data, memory_breakdown
from epl.planner.shape import ModelShape

#: Bytes a device keeps outside torch's allocator (the CUDA context, the communication libraries' buffers) when
#: deciding whether a plan fits.
RESERVED_BYTES = 2 * 2**30
#: The caching allocator's reserve: what it holds (``max_memory_reserved``) over the tensors' peak
#: (``max_memory_allocated``). 0.10 is the one published run found giving both (NeMo's Llama 3 8B on 8 B200s: 119.0
#: GiB reserved over 107.8 GiB allocated, 1.104; notes/issue-43-memory-runs.md, X1). Fragmentation varies with
#: the run: a typical figure, not a bound, so ``fits`` does not add it (with it, torchtitan's Llama 2 13B run
#: without recomputation, which ran on 80 GB H100s, would miss by 0.1 GiB); ``epl plan`` prints it beside the
#: peak, and reserved and nvidia-smi figures are predicted with it (:func:`reserved_bytes`, :func:`device_bytes`).
ALLOCATOR_RESERVE = 0.10


def device_bytes(peak: float) -> float:
    """What a device needs for tensors peaking at ``peak`` bytes: the peak, the allocator's reserve over it
    (:data:`ALLOCATOR_RESERVE`), and what the runtime keeps outside the allocator (:data:`RESERVED_BYTES`)."""
    return reserved_bytes(peak) + RESERVED_BYTES


def reserved_bytes(peak: float) -> float:
    """The allocator's reserved memory (``max_memory_reserved``) for tensors peaking at ``peak`` bytes."""
    return peak * (1 + ALLOCATOR_RESERVE)


#: What the estimate of a context-parallel layout assumes that EPL does not do yet (docs/context.md, "Not yet").
CONTEXT_KERNEL_NOTE = (
    "the attention is timed as SDPA runs it; EPL's ring and all-gather attention run each block through SDPA's "
    "flash kernel, one call per block, not yet timed against SDPA on a GPU (before: 5.6-7x slower on an H200; "
    "padded or packed batches take matrix products; docs/context.md)"
)
MFU_FORMULA = "MFU = (6*N + 12*L*h*s) * tokens / (step time * devices * peak FLOP/s); N: block and head weights"


@dataclass(frozen=True)
class Estimate:
    """A layout's predictions (the JSON object of one plan in ``epl plan --json``)."""

    layout: Layout
    parameters: float
    gradients: float
    optimizer: float
    activations: float
    peak: float
    step_time_s: float
    tokens_per_second: float
    mfu: float
    fits: bool
    #: The peak's stage, moment and terms (bytes by name), which add up to ``peak``.
    memory: MemoryBreakdown
    time_parts: dict[str, float] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """What ``epl plan --json`` writes for one layout (``layout``, ``memory_per_device``, ``step_time_s``, ...)."""
        return {
            "layout": self.layout.to_dict(),
            "memory_per_device": {
                "parameters": int(self.parameters), "gradients": int(self.gradients),
                "optimizer": int(self.optimizer), "activations": int(self.activations), "peak": int(self.peak),
                "peak_stage": self.memory.stage, "peak_moment": self.memory.moment,
                "peak_terms": {name: int(size) for name, size in self.memory.terms.items()},
            },
            "step_time_s": self.step_time_s,
            "tokens_per_second": self.tokens_per_second,
            "mfu": self.mfu,
            "fits": self.fits,
            "step_time_parts_s": dict(self.time_parts),
            "mfu_formula": MFU_FORMULA,
            "notes": list(self.notes),
        }  # fmt: skip


def estimate(shape: ModelShape, layout: Layout, workload: Workload, device: DeviceProfile) -> Estimate:
    """The predictions for ``layout`` of ``shape`` training ``workload`` on devices like ``device``."""
    if layout.context > 1:
        return _with_context(shape, layout, workload, device)
    memory = memory_breakdown(shape, layout, workload)
    tokens = workload.global_batch * workload.sequence
    parts, model_flops = _step_parts(shape, layout, workload, device)
    step = sum(parts.values())
    return Estimate(
        layout=layout,
        parameters=memory.terms["parameters"],
        gradients=memory.gradients,
        optimizer=memory.terms["optimizer"],
        activations=memory.activations,
        peak=memory.peak,
        step_time_s=step,
        tokens_per_second=tokens / step,
        mfu=model_flops / step / layout.devices / device.peak(workload.dtype),
        fits=memory.peak <= device.memory_bytes - RESERVED_BYTES,
        memory=memory,
        time_parts=parts,
    )


def _with_context(shape: ModelShape, layout: Layout, workload: Workload, device: DeviceProfile) -> Estimate:
    """Context parallelism over ``c`` devices: each device is a data-parallel copy (gradients and ZeRO over data x
    context devices) that holds ``s/c`` tokens of each of its replica's sequences and attends over all ``s``
    (saving no score matrix, as EPL's context attention), plus the ring's exposed time (``context_parallel``)."""
    inner = estimate(shape, *context_as_data(layout, workload), device)
    parts = {**inner.time_parts, "context_parallel": _ring_seconds(shape, layout, workload, device)}
    step = sum(parts.values())
    return replace(
        inner,
        layout=layout,
        step_time_s=step,
        tokens_per_second=workload.global_batch * workload.sequence / step,
        mfu=inner.mfu * inner.step_time_s / step,
        time_parts=parts,
        notes=(*inner.notes, CONTEXT_KERNEL_NOTE),
    )


def _ring_seconds(shape: ModelShape, layout: Layout, workload: Workload, device: DeviceProfile) -> float:
    """A step's ring attention on one device: per block and micro-batch, ``c-1`` hops of its keys and values
    forward (again under full recomputation), and backward ``c-1`` hops of keys, values and their gradients and
    one more of the gradients; nothing hidden behind compute (EPL's hops wait)."""
    c = layout.context
    kv_heads = math.ceil(shape.kv_heads / layout.tensor)  # a tensor shard's own key/value heads travel its ring
    share = layout.micro_batch_size * workload.sequence // c * kv_heads * shape.head_dim * workload.dtype_bytes
    forward_hops = (c - 1) * (2 if layout.gradient_checkpoint == "full" else 1)
    per_block = forward_hops * 2 * share + ((c - 1) * 4 + 2) * share
    hops = forward_hops + c
    blocks = stage_blocks(shape, layout) * layout.micro_batches
    # A context group's devices are a lane (t x p devices) apart: within a node while c lanes fit in it.
    lanes_in_node = c * layout.tensor * layout.pipeline <= workload.devices_per_node
    bandwidth = device.intra_node_bandwidth if lanes_in_node else device.inter_node_bandwidth
    return blocks * (per_block / bandwidth + hops * device.collective_latency_s / 2)


def _step_parts(
    shape: ModelShape, layout: Layout, workload: Workload, device: DeviceProfile
) -> tuple[dict[str, float], float]:
    """The seconds of each part of a step on the slowest device, and the step's model FLOPs."""
    t, p, d, m = layout.tensor, layout.pipeline, layout.data, layout.micro_batches
    s = workload.sequence
    span = workload.attention_length or s  # the keys each query attends over
    blocks = stage_blocks(shape, layout)
    weights = weights_per_device(shape, layout)
    tokens = workload.global_batch * s
    head = 6 * shape.vocab * shape.hidden  # per token
    block_matmuls = shape.layer_parameters() - 2 * shape.hidden
    block = 6 * block_matmuls + 12 * shape.hidden * span  # per token
    model_flops = tokens * (shape.layers * block + head)
    if layout.gradient_checkpoint == "full":
        block += 2 * block_matmuls + 4 * shape.hidden * span
    elif layout.gradient_checkpoint == "auto":
        block += 4 * shape.hidden * span
    # The slowest device: a stage of the most blocks, with the head (the last stage's), a tensor shard of it.
    stage_flops = tokens / d * (blocks * block + head) / t
    compute = stage_flops / (device.peak(workload.dtype) * device.efficiency)
    kernels, update = _memory_bound_seconds(shape, layout, workload, weights, device)
    block_calls = blocks * (4 / 3 if layout.gradient_checkpoint == "full" else 1)  # recomputation calls it again
    host = m * (block_calls * device.block_overhead_s + device.micro_batch_overhead_s)
    per_micro_batch = (compute + kernels + host) / m
    communication = _communication_seconds(shape, layout, workload, device, compute + kernels, per_micro_batch)
    bubble = 0.0
    if p > 1:
        bubble = (p - 1) * per_micro_batch
        if layout.schedule == "interleaved":
            bubble /= layout.virtual_stages
    parts = {"compute": compute, "memory_bound": kernels + update, "host_overhead": host, **communication,
             "bubble": bubble}  # fmt: skip
    return parts, model_flops


def _communication_seconds(
    shape: ModelShape, layout: Layout, workload: Workload, device: DeviceProfile, busy: float, per_micro_batch: float
) -> dict[str, float]:
    """Exposed seconds of tensor-parallel, pipeline and data-parallel communication in a step; ``busy``: the
    device's compute and memory-bound seconds, which FSDP's prefetched gathers hide behind."""
    t, d = layout.tensor, layout.data
    in_node = workload.devices_per_node
    payload = payload_bytes(shape, layout, workload)
    calls = collective_calls(shape, layout, workload)
    latency = device.collective_latency_s
    tp_bandwidth = device.intra_node_bandwidth if t <= in_node else device.inter_node_bandwidth
    tensor_comm = 2 * (t - 1) / t * payload["tensor_parallel"] / tp_bandwidth  # ring all-reduces
    tensor_comm += (t - 1) / t * payload["gathered_logits"] * t / tp_bandwidth  # a ring all-gather of t shares
    tensor_comm += (calls["tensor_parallel"] + calls["gathered_logits"]) * latency
    cross = t * d >= in_node
    bandwidth = device.inter_node_bandwidth if cross else device.intra_node_bandwidth
    pipeline_comm = payload["pipeline"] / bandwidth  # each tensor device sends the whole activation (EPL)
    pipeline_comm += calls["pipeline"] * latency / 2  # one message each; an all-reduce's latency is two
    data_comm = 0.0
    if d > 1:
        bandwidth = device.inter_node_bandwidth if t * d > in_node else device.intra_node_bandwidth
        # an all-reduce moves 2(d-1)/d of its bytes and costs the profile's latency (two messages); ZeRO's
        # reduce-scatters and all-gathers (FSDP2) half of each
        sharded = zero_shards(layout)
        passes, messages = (1, 0.5) if sharded else (2, 1.0)
        reduce = passes * (d - 1) / d * payload["data_parallel"] / bandwidth
        reduce += calls["data_parallel"] * latency * messages
        gather = (d - 1) / d * payload["zero_parameters"] / bandwidth + calls["zero_parameters"] * latency / 2
        if workload.weights_prefetched:  # FSDP: gathers and reductions run behind the whole step's compute
            data_comm = max(0.0, reduce + gather - device.overlap * busy)
        else:
            data_comm = reduce - device.overlap * min(reduce, per_micro_batch * 2 / 3) + gather
    return {"tensor_parallel": tensor_comm, "pipeline": pipeline_comm, "data_parallel": data_comm}


def _memory_bound_seconds(
    shape: ModelShape, layout: Layout, workload: Workload, weights: float, device: DeviceProfile
) -> tuple[float, float]:
    """Seconds one device spends on memory-bound work in a step: its blocks' elementwise kernels (a forward more
    under full recomputation) and the loss on the last stage; and the optimizer's update of its weights (a ZeRO
    share)."""
    t, d = layout.tensor, layout.data
    tokens = workload.global_batch // d * workload.sequence
    block = memory_traffic.block_bytes(shape, tokens, workload.sequence, workload.dtype_bytes, workload.sdpa)
    per_block = block.per_device(t, layout.sequence_parallel and t > 1)
    if layout.gradient_checkpoint in ("full", "ops"):  # the elementwise kernels run again, forward
        per_block *= 4 / 3
    loss = memory_traffic.loss_bytes(shape, tokens, t, workload.gathered_logits)
    kernels = stage_blocks(shape, layout) * per_block + loss
    update = memory_traffic.optimizer_bytes(updated_weights(shape, layout), workload.optimizer_states)
    update /= device.optimizer_bandwidth or device.memory_bandwidth
    if d > 1:
        zero = zero_collectives(layout, workload) if zero_shards(layout) else None
        packing = memory_traffic.packing_bytes(weights, workload.dtype_bytes, zero)
        update += packing / device.memory_bandwidth
    return kernels / device.memory_bandwidth, update
