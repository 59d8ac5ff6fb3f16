"""The memory-bound work of a step: bytes that elementwise kernels and the optimizer move through device memory.

A GEMM's time is its FLOPs; a norm's, a residual add's or an activation's is the bytes it reads and writes. Counted
per token of a block, forward, in passes over a tensor (one read or one write of every element), as PyTorch's
eager kernels run transformers' blocks:

- each RMSNorm/LayerNorm (two per block): 6 passes over ``h`` (transformers upcasts to float32, squares, averages,
  scales, casts back and multiplies by the weight);
- each residual add (two): 3 passes over ``h``;
- rotary positions on q and k: 8 passes over ``h + h_kv`` (``rotate_half``'s negation and concatenation, two
  products and a sum);
- the MLP's activation: 2 passes over ``f``, and for a gated MLP 3 more (the gate's product);
- eager attention: 4 passes over the ``a·s`` scores (softmax and its dropout); fused SDPA/flash kernels keep
  them on chip.

The backward moves about twice the forward's bytes; full recomputation runs the forward once more. Norms and
residual adds run whole on every device of a shard group unless sequence parallel; the rest is divided among
them. The loss reads and writes the float32 logits about 6 times (upcast, log-softmax, its gradient). Adam, as
torch runs it by default (``foreach``), makes :data:`ADAM_ACCESSES` float32 reads and writes per parameter it
updates. Data parallelism copies gradients into flat buckets, and ZeRO gradients into reduce-scatter buffers and
gathered weights out of all-gather buffers (:func:`packing_bytes`). ``epl calibrate`` measures the bandwidth these
kernels reach by running a norm, a gated activation and a residual add, so the counts and the bandwidth agree by
construction.
"""

from __future__ import annotations

from epl.planner.activations import BlockActivations
from epl.planner.shape import ModelShape

#: Passes over ``h`` of each of a block's two norms (upcast, square, average, scale, cast back, weight).
NORM_PASSES = 6
#: Passes over ``h`` of each of a block's two residual adds (two reads, one write).
RESIDUAL_PASSES = 3
#: Passes over ``f`` of the MLP's activation (read, write).
ACTIVATION_PASSES = 2
#: Passes over ``f`` a gated MLP adds: the gate's product (two reads, one write).
GATE_PASSES = 3
#: A block's backward moves about twice its forward's bytes: forward and backward together move this many times.
FORWARD_AND_BACKWARD = 3

#: float32 reads and writes per parameter of torch's default (foreach) Adam step: lerp, mul, addcmul, sqrt, div,
#: add, addcdiv.
ADAM_ACCESSES = 18
#: Passes over the float32 logits per token: upcast, log-softmax forward, its gradient.
LOSS_PASSES = 6
#: Passes over the whole logits when split gathers them: the gathered output written, its pieces concatenated
#: (read and written), and in backward the gradient read and its share written.
GATHER_PASSES = 5


def block_bytes(shape: ModelShape, tokens: int, sequence: int, dtype_bytes: int, sdpa: bool) -> BlockActivations:
    """Bytes one block's forward and backward move through memory outside GEMMs, for ``tokens`` tokens:
    ``replicated`` (norms and residual adds) and ``sharded`` (divided over a shard group)."""
    h, f, kv = shape.hidden, shape.ffn, shape.kv_heads * shape.head_dim
    replicated = 2 * NORM_PASSES * h + 2 * RESIDUAL_PASSES * h
    sharded = 8 * (h + kv) + (ACTIVATION_PASSES + (GATE_PASSES if shape.gated else 0)) * f
    if not sdpa:
        sharded += 4 * shape.heads * sequence
    forward_and_backward = FORWARD_AND_BACKWARD * tokens * dtype_bytes
    return BlockActivations(replicated=replicated * forward_and_backward, sharded=sharded * forward_and_backward)


def loss_bytes(shape: ModelShape, tokens: int, tensor: int, gathered: bool = False) -> float:
    """Bytes the loss moves over one device's share of the float32 logits of ``tokens`` tokens; ``gathered``: the
    model computes its own loss, so each device gathers the whole logits (written, reordered into one tensor, and
    the gradient's share sliced back out: :data:`GATHER_PASSES`) and runs the loss on all of them."""
    if gathered and tensor > 1:
        return (LOSS_PASSES + GATHER_PASSES) * tokens * shape.vocab * 4
    return LOSS_PASSES * tokens * shape.vocab / tensor * 4


def optimizer_bytes(parameters: float, optimizer_states: int) -> float:
    """Bytes an Adam-like step moves to update ``parameters`` (float32); no states, no update traffic but SGD's."""
    accesses = ADAM_ACCESSES if optimizer_states >= 2 else 3 + 2 * optimizer_states
    return parameters * accesses * 4


def packing_bytes(weights: float, dtype_bytes: int, zero: tuple[int, int] | None = None) -> float:
    """Bytes data parallelism copies to communicate, on a device holding ``weights``: its float32 gradients into
    flat buckets (read and written) once a step; under ZeRO (FSDP2), ``zero`` the reduce-scatters and all-gathers of
    each block a step (:func:`epl.planner.communication.zero_collectives`), each block's gradients into the
    reduce-scatter's buffer at each reduction and its weights out of the all-gather's buffer at each gather."""
    if zero is None:
        return 2 * weights * 4
    reductions, gathers = zero
    return reductions * 2 * weights * 4 + gathers * 2 * weights * dtype_bytes
