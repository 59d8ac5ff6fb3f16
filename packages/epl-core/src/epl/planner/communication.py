"""The payload bytes one device hands to collectives in a step, by kind, as EPL runs a layout.

Payload is what a collective is given (an all-reduce's tensor, a point-to-point message), not what the wire
carries: ``estimate`` turns payloads into time with each algorithm's factor. Per step, on a device of the first
pipeline stage:

- **tensor parallel** (``split``): per block and micro-batch, two all-reduces of the activations forward (after
  the attention's and the MLP's row-parallel projections) and two backward (before their column-parallel
  inputs); per micro-batch one more for the vocabulary-parallel embedding's output, and one for the gradient of
  the head's input (Megatron's pairing: 4 per block + 2, asserted in benchmarks/test_split_llama.py); full
  recomputation repeats a block's two forward all-reduces;
- **pipeline**: per micro-batch, the activations sent forward and their gradient received back across each
  boundary the device sits on;
- **data parallel**: the gradients of the weights the device holds (its shards, and the norms whole), all-reduced
  once per step (reduced to their owners under ZeRO v1 and v2);
- **ZeRO's weights** (``zero_parameters``): under v0 and v1 each owner broadcasts its updated shard after the
  step (the whole weights, over the owners); under v2 the weights are gathered (broadcast by their owners) before
  each micro-batch's forward and again for its backward.

Left out, and small: the parallel cross-entropy's all-reduces of a max and a sum per token, and a norm's
gradient summed over a shard group.
"""

from __future__ import annotations

import math

from epl.planner.layout import Layout, Workload
from epl.planner.shape import ModelShape


def weights_per_device(shape: ModelShape, layout: Layout) -> float:
    """Weights one device of the first (or last) pipeline stage holds: ``ceil(L/p)`` blocks and the embedding (or
    head) divided over the tensor devices, the norms whole on each."""
    p = layout.pipeline
    blocks = math.ceil(shape.layers / p)
    embedding = shape.vocab * shape.hidden * (1 if p > 1 or shape.tied else 2)
    norms = 2 * shape.hidden * blocks + (shape.hidden if p == 1 else 0)
    return (blocks * (shape.layer_parameters() - 2 * shape.hidden) + embedding) / layout.tensor + norms


def payload_bytes(shape: ModelShape, layout: Layout, workload: Workload, grad_bytes: int = 4) -> dict[str, float]:
    """Bytes per step one device hands to tensor-parallel, pipeline and data-parallel collectives."""
    t, p, d, m = layout.tensor, layout.pipeline, layout.data, layout.micro_batches
    message = layout.micro_batch_size * workload.sequence * shape.hidden * workload.dtype_bytes
    blocks = math.ceil(shape.layers / p)
    tensor = 0.0
    if t > 1:
        per_block = 6 if layout.gradient_checkpoint == "full" else 4  # recomputing a block repeats its forward's 2
        per_micro_batch = per_block * blocks + (2 if p == 1 else 1)  # the embedding on the first stage, the head last
        tensor = per_micro_batch * m * message
    pipeline = 2 * m * message if p > 1 else 0.0
    data = parameters = 0.0
    if d > 1:
        weights = weights_per_device(shape, layout)
        data = weights * grad_bytes
        if layout.zero in ("v0", "v1"):  # each owner broadcasts its updated shard after the step
            parameters = weights * workload.dtype_bytes
        elif layout.zero == "v2":  # the whole weights gathered before each micro-batch's forward and backward
            parameters = 2 * m * weights * workload.dtype_bytes
    return {"tensor_parallel": tensor, "pipeline": pipeline, "data_parallel": data, "zero_parameters": parameters}
