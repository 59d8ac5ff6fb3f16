"""Offload's gradients summed over micro-batches in host memory without stalling the device.

Under FSDP2's ``CPUOffloadPolicy`` each block's gradient is copied to host memory as its backward ends. FSDP2 copies
it asynchronously, on a side stream into pinned memory, only when the parameter has no gradient yet. When it has one
(the second micro-batch of a step and later), FSDP2 copies synchronously into pageable memory and adds on the CPU
inside the backward, block by block, and the GPU waits for each block's copy and add.

:class:`HostGradientSums` keeps FSDP2 on its fast path. Each parameter's gradient is taken away when a backward
reaches its first sharded block (so FSDP2 finds none and copies asynchronously) and when the backward ends, after
FSDP2's copies are done. What was taken is summed on a worker thread while the next micro-batch computes, and the sum
becomes the parameter's gradient again when the step's last backward ends. Measured on an H200 (0.34B Llama, 4
micro-batches of 2 sequences of 2,048 tokens): 1.03-1.08 s a step against 2.02 s with FSDP2's own accumulation.

Only the local step runner says that more micro-batches follow (:func:`epl.plugin_api.listen_to_micro_batches`):
any other backward (a pipeline's micro-batch, a user's own) ends with the sums back in the gradients, so a gradient
is never hidden from whoever reads it. Every gradient FSDP2 writes is counted exactly once, whatever the order of
the hooks. Sums left by a step that raised are dropped when the next step begins, or by the next backward.
It costs one more copy of this rank's gradient chunks in host memory while a step's micro-batches run.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from epl.plugin_api import (
    current_graph_task_id,
    listen_to_micro_batches,
    local_tensor,
    queue_backward_callback,
    tree_leaves,
)


class HostGradientSums:
    """Sums offloaded gradient chunks over a step's micro-batches outside the backward (see the module doc)."""

    def __init__(self, params: Sequence[nn.Parameter], device: torch.device) -> None:
        #: The parameters FSDP2 offloads (sharded DTensors with host chunks).
        self.params = list(params)
        self.device = device
        #: id(param) -> (param, the gradients taken from it in this step and not yet given back).
        self._taken: dict[int, tuple[nn.Parameter, list[torch.Tensor]]] = {}
        #: The autograd graph task of the backward under way (-1: none).
        self._task = -1
        #: Whether the local step runner said that more micro-batches of this step follow the next backward.
        self._more = False
        self._worker: ThreadPoolExecutor | None = None
        self._summing: Future[None] | None = None

    def __getstate__(self) -> dict[str, Any]:
        """What a copy of the model (``copy.deepcopy``, an EMA's start) takes: the parameters, no sums, no worker."""
        state = self.__dict__.copy()
        state.update(_taken={}, _task=-1, _more=False, _worker=None, _summing=None)
        return state

    def install(self, model: nn.Module, units: Sequence[nn.Module]) -> None:
        """Watch each sharded block's backward (a forward hook registered after FSDP2's), and hear the local step
        runner's micro-batches."""
        for unit in units:
            unit.register_forward_hook(self._watch_backward)
        listen_to_micro_batches(model, self._micro_batch)

    def _micro_batch(self, index: int, count: int) -> None:
        """The local step runner's micro-batch ``index`` of ``count`` is about to run."""
        if index == 0:
            self._drop()  # a step that raised left its sums
        self._more = index < count - 1

    def _watch_backward(self, module: nn.Module, args: Any, output: Any) -> None:
        """Forward hook: call :meth:`_backward_reaches_block` when the backward reaches ``module``'s outputs."""
        if not torch.is_grad_enabled():
            return
        tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, self._backward_reaches_block, mode="any")

    def _backward_reaches_block(self, grad: Any) -> None:
        """The first time in a backward: take the gradients there are, and have the backward end in :meth:`_end`."""
        task = current_graph_task_id()
        if task == self._task:
            return
        if self._task != -1:  # the backward before this one raised
            self._drop()
        self._task = task
        self._wait()  # the worker's lists are the main thread's again
        self._take()
        queue_backward_callback(self._end)

    def _end(self) -> None:
        """End of a backward: take what it wrote; sum on the worker when more micro-batches follow, else give the
        sums back as the gradients."""
        self._task = -1
        more, self._more = self._more, False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # FSDP2's copies into host memory are done
        self._wait()
        self._take()
        if more:
            if self._worker is None:
                self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epl-host-gradients")
            self._summing = self._worker.submit(self._sum)
            return
        self._sum()
        for param, (total,) in self._taken.values():
            param.grad = total
        self._taken.clear()

    def _take(self) -> None:
        """Move every parameter's gradient into the taken lists."""
        for param in self.params:
            if param.grad is not None:
                self._taken.setdefault(id(param), (param, []))[1].append(param.grad)
                param.grad = None

    @torch.no_grad()
    def _sum(self) -> None:
        """Add each parameter's taken gradients into its first (on the worker between micro-batches)."""
        for _, taken in self._taken.values():
            local = local_tensor(taken[0])
            for more in taken[1:]:
                local.add_(local_tensor(more))
            del taken[1:]

    def _wait(self) -> None:
        """Wait for the worker's sums (and raise its error)."""
        summing, self._summing = self._summing, None
        if summing is not None:
            summing.result()

    def _drop(self) -> None:
        """Forget every sum (a step that raised)."""
        try:
            self._wait()
        finally:
            self._taken.clear()
            self._task = -1
