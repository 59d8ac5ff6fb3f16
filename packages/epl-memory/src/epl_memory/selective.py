"""Selective activation checkpointing: the policy of ``gradient_checkpoint.type = "selective"``.

Inside a checkpointed block, torch's selective checkpointing
(:func:`torch.utils.checkpoint.create_selective_checkpoint_contexts`) keeps the outputs of the operations
:func:`policy` marks ``MUST_SAVE`` and recomputes the rest in backward: the matrix products (``mm``, ``addmm``,
``bmm``, ``baddbmm``: what ``nn.Linear`` and ``matmul`` run), the fused attention kernels' outputs (SDPA's output
and log-sum-exp, never a score-sized tensor) and functional collectives' outputs are saved; norms, activation
functions, rotary embeddings, residual additions and other elementwise work are recomputed from them. This is
torchtitan's per-operation policy (``torchtitan/distributed/activation_checkpoint.py``) without its "every other
mm", and Korthikanti et al.'s selective recomputation in kind: the expensive products are never run twice.

torch.distributed's in-place collectives (what EPL's split layers call) are recomputed, as whole-block
recomputation runs them: a saved in-place result would leave the recomputed tensor it wrote to unreduced. Under
``epl.split`` that is one all-reduce more per block and micro-batch, the attention's (backward needs the MLP's input,
which follows it; torch's recomputation stops before the MLP's), as under ``auto``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts


def _ops(namespace: Any, names: tuple[str, ...]) -> frozenset[Any]:
    """The default overloads of ``names`` that this torch build has."""
    found = []
    for name in names:
        packet = getattr(namespace, name, None)
        if packet is not None and hasattr(packet, "default"):
            found.append(packet.default)
    return frozenset(found)


#: Matrix products: ``nn.Linear`` and ``matmul`` reach the dispatcher as these.
MATRIX_PRODUCTS = _ops(torch.ops.aten, ("mm", "addmm", "bmm", "baddbmm", "linear", "_scaled_mm"))
#: The fused attention kernels (their forward's output, log-sum-exp and random state).
ATTENTION = _ops(
    torch.ops.aten,
    (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    ),
)
#: Functional collectives (out of place: their output can be reused as it is).
COLLECTIVES = _ops(
    torch.ops._c10d_functional,
    ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"),
)
#: Every operation whose output selective checkpointing keeps.
SAVED = MATRIX_PRODUCTS | ATTENTION | COLLECTIVES


def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Save :data:`SAVED`'s outputs, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED else CheckpointPolicy.PREFER_RECOMPUTE


def context_fn() -> tuple[Any, Any]:
    """The forward's and the recomputation's contexts for ``torch.utils.checkpoint.checkpoint(context_fn=...)``."""
    return create_selective_checkpoint_contexts(policy)


def checkpointed(function: Callable[..., Any], selective: bool) -> Callable[..., Any]:
    """``function`` run under non-reentrant ``torch.utils.checkpoint`` (random state preserved), selectively
    (:func:`policy`) or recomputed whole."""
    extra: dict[str, Any] = {"context_fn": context_fn} if selective else {}
    return functools.partial(torch.utils.checkpoint.checkpoint, function, use_reentrant=False, **extra)
