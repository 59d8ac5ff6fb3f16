"""Activation memory: what a block saves for backward per micro-batch, and how many micro-batches a schedule keeps.

Counted tensor by tensor, as Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", section 4.1) count them, generalised to grouped key/value heads and gated MLPs. Per token of a block,
in elements of the activation dtype:

- the two norms' inputs (2h), the inputs of the q/k/v projection (h), of the output projection (h), of the MLP's
  first projection (h) and of its last (f);
- the attention core: q (h), k and v (h_kv each) and its output (h) with fused SDPA/flash kernels; eager (as
  transformers' eager attention runs it), k and v repeated to every head (h each), the softmax output and its
  dropout's (a·s each, the dropout runs even at p=0) and, with dropout, its mask (a·s bytes);
- the MLP's activation: what the activation function saves (its input, f, for torch's fused functions;
  measured once per function, :func:`epl.planner.shape.activation_saves`), and for a gated MLP the gate's
  activation and the up projection (2f);
- with dropout, the masks of the attention's and the MLP's residual dropouts (h bytes each).

With GPT's shapes (h_kv = h, f = 4h, no gate, LayerNorm, dropout, eager attention, 2-byte activations) this is
Korthikanti's 34·s·b·h + 5·a·s²·b bytes, and under tensor parallelism of t without sequence parallelism
s·b·h·(10 + 24/t + 5·a·s/(h·t)) (tests/planner/test_activations.py checks both). Sequence parallelism divides
everything by t. ``full`` checkpointing keeps a block's input only; ``auto`` (selective) drops the attention
core's score-sized tensors. With Megatron-Core's fused kernels (``fused``), the flash kernel's output is the output
projection's input (one tensor: its layout is already ``[s, b, h]``, where transformers copies it), and a SwiGLU
kernel saves its input (gate and up, 2f) instead of the gate's activation, its output and the up projection (3f).
"""

from __future__ import annotations

from dataclasses import dataclass

from epl.planner.layout import Layout
from epl.planner.shape import ModelShape


@dataclass(frozen=True)
class BlockActivations:
    """Bytes one block saves for one micro-batch: ``replicated`` (whole on every device of a shard group unless
    sequence parallel) and ``sharded`` (divided among them)."""

    replicated: float
    sharded: float

    def per_device(self, tensor: int, sequence_parallel: bool) -> float:
        """Bytes on one device of a shard group of ``tensor`` devices."""
        if sequence_parallel:
            return (self.replicated + self.sharded) / tensor
        return self.replicated + self.sharded / tensor


def block_activations(
    shape: ModelShape,
    micro_batch: int,
    sequence: int,
    *,
    dtype_bytes: int = 2,
    sdpa: bool = True,
    dropout: bool = False,
    checkpoint: str = "none",
    fused: bool = False,
) -> BlockActivations:
    """What one block saves for backward for one micro-batch of ``micro_batch`` sequences of ``sequence`` tokens;
    ``fused``: with Megatron-Core's kernels (:attr:`epl.planner.layout.Workload.fused_kernels`)."""
    tokens = micro_batch * sequence
    h, f, a = shape.hidden, shape.ffn, shape.heads
    kv = shape.kv_heads * shape.head_dim
    e = dtype_bytes
    if checkpoint == "full":
        return BlockActivations(replicated=tokens * h * e, sharded=0.0)
    if checkpoint == "ops":
        return _products_only(shape, tokens, sequence, e, sdpa)
    replicated = tokens * (2 * h + h + h) * e  # norm inputs, q/k/v and MLP inputs
    sharded = tokens * (h + f) * e  # the output projection's and the last MLP projection's inputs
    scores = 0.0
    if sdpa:
        core = tokens * (h + 2 * kv) * e  # q, k, v
        if not fused:  # the fused kernel's output (its log-sum-exp is a few floats per row), copied to [s, b, h]
            core += tokens * h * e
    else:  # eager: k and v repeated to every head, the softmax's output and its dropout's (even at p=0)
        core = tokens * 3 * h * e
        scores = tokens * a * sequence * e * 2 + (tokens * a * sequence if dropout else 0)
    mlp = tokens * (shape.activation_saves + (2 if shape.gated else 0)) * f * e
    if fused and shape.gated:  # one SwiGLU kernel saves its input, gate and up (2f), and recomputes the rest
        mlp = tokens * 2 * f * e
    if dropout:  # the masks of the attention's and the MLP's residual dropouts, a byte per element
        replicated += 2 * tokens * h
    if checkpoint == "auto":  # selective: the score-sized tensors are recomputed
        # Korthikanti's count, which the published selective runs are checked against. EPL's "selective" (torch's
        # per-operation policy) also recomputes the norms, rotary and the MLP's activation from the saved products
        # and SDPA's output: it keeps (5h + 2 h_kv + 2f) per token and the log-sum-exp, 0.6 of this on transformers'
        # Llama with SDPA (measured in tests/planner/test_measured_activations.py): for EPL an upper bound.
        scores = 0.0
    return BlockActivations(replicated=replicated, sharded=sharded + core + scores + mlp)


def _products_only(shape: ModelShape, tokens: int, sequence: int, e: int, sdpa: bool) -> BlockActivations:
    """``ops``: torch's per-operation policy (EPL's ``selective``) keeps the block's input and the outputs of its
    matrix products and attention kernel, and recomputes the rest: the input, the output projection's and the last
    MLP projection's outputs whole (3h), q (h), k and v (h_kv each), the attention's output (h) and its float32
    log-sum-exp, the MLP's first products (2f gated, f otherwise) sharded. Eager attention keeps its two batched
    products' outputs instead: the scores (a·s) and the output (h). Measured on transformers' Llama within 10%
    (tests/planner/test_measured_activations.py)."""
    h, f, a = shape.hidden, shape.ffn, shape.heads
    kv = shape.kv_heads * shape.head_dim
    firsts = (2 if shape.gated else 1) * f
    if sdpa:
        attention = tokens * (h + 2 * kv + h) * e + tokens * a * 4
    else:
        attention = tokens * (h + 2 * kv + h) * e + tokens * a * sequence * e
    return BlockActivations(replicated=tokens * 3 * h * e, sharded=attention + tokens * firsts * e)


def micro_batches_in_flight(layout: Layout, stage: int = 0) -> float:
    """Micro-batches whose activations pipeline ``stage`` holds at once, in units of its own layers' activations
    (measured on transformers' Llama in tests/planner/test_measured_memory.py): GPipe all of them; 1F1B
    ``p - stage``; EPL's ZeroBubble ``p`` on every stage (a stage keeps the inputs of its pending weight-gradient
    passes: 2.0 and 1.95 measured on 2 stages, 4.0, 4.0, 4.0 and 3.86 on 4); interleaved 1F1B with ``v`` chunks
    Megatron-LM's warm-up plus one, ``2(p - 1 - stage) + (v - 1)·N + 1`` chunk micro-batches of ``1/v`` of the
    stage's layers, ``N`` the micro-batches run in a row on a chunk (``Layout.interleave_group``, ``p`` by
    default): Korthikanti's ``p·(1 + (p-1)/(p·v))`` on the first stage, and on the last ``(v-1)·p + 1`` chunks,
    nearly ``p`` micro-batches where 1F1B keeps one. Never more than the micro-batches."""
    p, m = layout.pipeline, layout.micro_batches
    if p == 1:
        return 1.0
    if layout.schedule == "GPipe":
        return float(m)
    if layout.schedule == "interleaved":
        v, group = layout.virtual_stages, layout.interleave_group or p
        return min(float(m), (2 * (p - 1 - stage) + (v - 1) * group + 1) / v)
    if layout.schedule == "ZeroBubble":
        return float(min(m, p))
    return float(min(m, p - stage))
