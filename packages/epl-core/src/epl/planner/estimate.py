"""One layout's predicted memory per device, step time and its parts, tokens/s and MFU.

**Memory** of the most loaded device (the first pipeline stage, or the last when its head is larger): the
weights of ``ceil(L/p)`` blocks and the embedding or head, divided over the tensor devices, the norms whole
(:func:`epl.planner.communication.weights_per_device`); in bf16/fp16 a
float32 master copy besides; float32 gradients; the optimizer's states (float32); ZeRO v0 divides the states
and master weights over the data devices, v1 the gradients too, v2 the weights too. Activations: a block's per
micro-batch (:mod:`epl.planner.activations`) times the stage's blocks times the micro-batches the schedule keeps,
plus, on the last stage, the float32 logits of one micro-batch and their gradient. Peak: all of it plus one
block's activations (recomputation, or the backward's working set).

**Time.** Model FLOPs are PaLM's (Chowdhery et al. 2022, appendix B): ``6·N + 12·L·h·s`` per token, N the
weights of the blocks and the head, recomputation not counted; MFU is model FLOPs per second over the devices'
peak. The hardware also runs the recomputation: a block's forward again under ``full`` checkpointing, the
attention core's under ``auto``. Parts of a step, on one device:

- compute: hardware FLOPs / (peak x the profile's efficiency);
- tensor parallel: the activation all-reduces of :func:`epl.planner.communication.payload_bytes` (4 per block and
  micro-batch, 6 under ``full`` checkpointing, and the embedding's and head's), ``2(t-1)/t`` of the bytes each,
  not overlapped (as Megatron without overlap);
- pipeline: a micro-batch's activations forward and their gradient back per stage boundary and micro-batch;
- data parallel: float32 gradients, ``2(d-1)/d`` of their bytes, and ZeRO's weights (``(d-1)/d`` of them after
  the step under v0 and v1, before each micro-batch's forward and backward under v2: :mod:`epl.planner.communication`),
  overlapped with the backward of the last micro-batch;
- bubble: ``(p-1)`` micro-batch times under GPipe and 1F1B, divided by the virtual stages under interleaved
  1F1B, and a third of it under ZeroBubble (ZB-H1, Qi et al. 2023).

Tensor groups sit inside a node; data and pipeline groups cross nodes once ``t·d`` passes the node's devices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from epl.planner.activations import block_activations, micro_batches_in_flight
from epl.planner.communication import payload_bytes, weights_per_device
from epl.planner.devices import DeviceProfile
from epl.planner.layout import Layout, Workload
from epl.planner.shape import ModelShape

#: Bytes a device keeps for itself (CUDA context, allocator slack) when deciding whether a plan fits.
RESERVED_BYTES = 2 * 2**30
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
    time_parts: dict[str, float] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The keys the issue and DESIGN.md name (``layout``, ``memory_per_device``, ``step_time_s``, ...)."""
        return {
            "layout": self.layout.to_dict(),
            "memory_per_device": {
                "parameters": int(self.parameters), "gradients": int(self.gradients),
                "optimizer": int(self.optimizer), "activations": int(self.activations), "peak": int(self.peak),
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
    t, p, d, m, b = layout.tensor, layout.pipeline, layout.data, layout.micro_batches, layout.micro_batch_size
    s, e = workload.sequence, workload.dtype_bytes
    sequence_parallel = layout.sequence_parallel and t > 1
    blocks = math.ceil(shape.layers / p)
    weights = weights_per_device(shape, layout)
    master = 4 if workload.mixed else 0
    parameter_bytes = weights * (e + master)
    gradient_bytes = weights * 4
    optimizer_bytes = weights * 4 * workload.optimizer_states
    if layout.zero in ("v0", "v1", "v2"):
        optimizer_bytes /= d
        parameter_bytes = weights * e + weights * master / d
    if layout.zero in ("v1", "v2"):
        gradient_bytes /= d
    if layout.zero == "v2":
        parameter_bytes = weights * (e + master) / d

    block = block_activations(shape, b, s, dtype_bytes=e, sdpa=workload.sdpa, checkpoint=layout.gradient_checkpoint)
    per_block = block.per_device(t, sequence_parallel)
    whole_block = block_activations(shape, b, s, dtype_bytes=e, sdpa=workload.sdpa).per_device(t, sequence_parallel)
    in_flight = micro_batches_in_flight(layout) if p > 1 else 1.0
    if p == 1 and m > 1:
        in_flight = 1.0  # gradient accumulation: one micro-batch at a time
    logits = 2 * b * s * shape.vocab / t * 4  # the last stage's float32 logits and their gradient
    first_stage = blocks * per_block * in_flight
    last_stage = blocks * per_block * 1.0 + logits
    activations = max(first_stage, last_stage if p > 1 else first_stage + logits)
    peak = parameter_bytes + gradient_bytes + optimizer_bytes + activations + whole_block
    fits = peak <= device.memory_bytes - RESERVED_BYTES

    tokens = workload.global_batch * s
    head = shape.vocab * shape.hidden
    block_matmuls = shape.layer_parameters() - 2 * shape.hidden
    model_flops = tokens * (6 * (shape.layers * block_matmuls + head) + 12 * shape.layers * shape.hidden * s)
    recompute = 0.0
    if layout.gradient_checkpoint == "full":
        recompute = tokens * (2 * shape.layers * block_matmuls + 4 * shape.layers * shape.hidden * s)
    elif layout.gradient_checkpoint == "auto":
        recompute = tokens * 4 * shape.layers * shape.hidden * s
    peak_flops = device.peak(workload.dtype)
    compute = (model_flops + recompute) / layout.devices / (peak_flops * device.efficiency)
    per_micro_batch = compute / m

    in_node = workload.devices_per_node
    payload = payload_bytes(shape, layout, workload)
    tp_bandwidth = device.intra_node_bandwidth if t <= in_node else device.inter_node_bandwidth
    tensor_comm = 2 * (t - 1) / t * payload["tensor_parallel"] / tp_bandwidth  # ring all-reduces
    cross = t * d >= in_node
    bandwidth = device.inter_node_bandwidth if cross else device.intra_node_bandwidth
    pipeline_comm = payload["pipeline"] / t / bandwidth  # each tensor device sends its part (Megatron's scatter)
    data_comm = 0.0
    if d > 1:
        bandwidth = device.inter_node_bandwidth if t * d > in_node else device.intra_node_bandwidth
        moved = (d - 1) / d * (2 * payload["data_parallel"] + payload["zero_parameters"])
        data_comm = max(0.0, moved / bandwidth - per_micro_batch * 2 / 3)
    bubble = 0.0
    if p > 1:
        bubble = (p - 1) * per_micro_batch
        if layout.schedule == "interleaved":
            bubble /= layout.virtual_stages
        elif layout.schedule == "ZeroBubble":
            bubble /= 3
    step = compute + tensor_comm + pipeline_comm + data_comm + bubble
    parts = {
        "compute": compute, "tensor_parallel": tensor_comm, "pipeline": pipeline_comm,
        "data_parallel": data_comm, "bubble": bubble,
    }  # fmt: skip
    return Estimate(
        layout=layout,
        parameters=parameter_bytes,
        gradients=gradient_bytes,
        optimizer=optimizer_bytes,
        activations=activations,
        peak=peak,
        step_time_s=step,
        tokens_per_second=tokens / step,
        mfu=model_flops / step / layout.devices / peak_flops,
        fits=fits,
        time_parts=parts,
    )
