"""Offload v0 on torch's FSDP2: weights, gradients and optimizer state in host memory; the optimizer steps there.

``offload.level = v0`` hands each block to ``fully_shard`` with FSDP2's ``CPUOffloadPolicy``
(:class:`epl_memory.zero.ZeroSharding` does the sharding): each device's chunk of every tensor lives in pinned host
memory. A block's weights are copied to the device on FSDP2's all-gather stream just before its forward (the next
block's copy posted while this one computes) and again before its backward, and are freed after each; each block's
gradient is copied to host memory on the reduce-scatter stream as its backward ends. The user's optimizer is built
over the host chunks, so its state lives in host memory and its step runs on the CPU.

- With ``zero.level``, the chunks are ZeRO's (``1/N`` of every tensor on each of ``N`` copies).
- Without it, every device keeps whole tensors in host memory: a one-device shard, replicated over the copies
  (FSDP2's hybrid sharding of shard degree 1), so data parallelism averages the gradients as before.
- A job of one process gets a process group of its own over an in-process store (FSDP2 needs one; nothing listens).

A step's micro-batches sum their gradients in host memory on a worker thread, off the backward
(:mod:`epl_memory.host_gradients`). The optimizer's step runs after the whole backward, not overlapped with it:
clipping's norm, AMP's unscaling and EPL's non-finite verdict need every gradient before any update, and EPL never
applies a step it may skip.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from epl.plugin_api import WrapperPhase

if TYPE_CHECKING:
    from epl.plugin_api import ParallelContext


_log = logging.getLogger("epl.memory")

#: What ``offload.level`` does in a job of one process without an accelerator.
CPU_NOTE = (
    "offload.level 'v0' keeps weights, gradients and optimizer state in host memory and moves each block's weights "
    "to the accelerator just in time; this process runs on the CPU, where they already are in host memory, so "
    "offloading changes nothing here."
)


def offloads(context: ParallelContext) -> bool:
    """Whether ``offload.level`` moves anything: set, and not a job of one process on the CPU (whose host memory is
    its device memory; several processes on the CPU go through the same FSDP2 path as on GPUs)."""
    from epl_memory.settings import MemorySettings

    return bool(MemorySettings.from_config(context.config).offload.level) and not (
        context.plan.local and context.cluster.device.type == "cpu"
    )


#: torch optimizers with a fused CPU kernel, which steps the host chunks about 4x faster than the per-tensor loop
#: (AdamW over 126M float32 parameters on 2 cores: 100 against 414 ms, DTensor chunks).
FUSED_ON_CPU = ("Adam", "AdamW", "SGD", "Adagrad")


class OffloadAdvice:
    """Optimizer wrapper (``offload.level``): says once when the CPU's step could use torch's fused kernel."""

    name = "offload_advice"
    phase = WrapperPhase.OFFLOAD

    def __call__(self, optimizer: torch.optim.Optimizer, context: ParallelContext) -> torch.optim.Optimizer:
        """Log the advice where it applies; return ``optimizer`` unchanged."""
        kind = type(optimizer).__name__
        if kind in FUSED_ON_CPU and not optimizer.defaults.get("fused"):
            _log.warning(
                "offload.level: the optimizer steps in host memory, on the CPU; torch.optim.%s(..., fused=True) "
                "steps there about 4x faster than the per-tensor loop it runs now.",
                kind,
            )
        return optimizer
