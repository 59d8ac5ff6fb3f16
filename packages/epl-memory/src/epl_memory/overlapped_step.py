"""``offload.overlap_step``: the CPU's optimizer step runs while the next step's forward runs, block by block.

Under offload the optimizer steps the host chunks on the CPU after the backward. It cannot start earlier and stay
exact: clipping's norm, AMP's unscaling and EPL's non-finite verdict need every gradient before any update. What can
overlap is the *next* forward. :class:`OverlappedHostStep` makes ``optimizer.step()`` return at once and steps the
parameters on a worker thread, one block at a time in the order the forward uses them; each sharded block's forward
waits (before FSDP2 copies its weights to the device) until its own parameters, and those of the block whose copy it
posts ahead, are updated. The arithmetic is the same as one whole step: each parameter's update reads only its own
gradient and state (those optimizers only: :mod:`epl_memory.optimizer_kinds`), with the hyperparameters of the moment
``step()`` was called (an LR scheduler steps right after it).

Nothing reads a half-updated weight through EPL: ``engine.model``, ``engine.optimizer``, ``engine.parameters()``,
``state_dict``, ``save``/``load``, ``predict`` and the optimizer's own ``state_dict``/``load_state_dict`` wait for the
update first (:func:`epl.plugin_api.settle_pending_update`), and the model's forward returns only once every block is
updated. A reference to the model kept from before ``epl.parallelize`` reads the host chunks directly: between two
steps, read through ``engine.model`` instead. That is why it is off by default.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from epl.plugin_api import EplError, defer_reads_until_settled
from epl_memory.optimizer_kinds import known_names, updates_each_parameter_alone
from epl_memory.optimizer_methods import replace_method

_log = logging.getLogger("epl.memory")

#: Seconds a forward waits for the CPU's update of a block, and a read for the whole update.
STEP_TIMEOUT_S = 1800.0
#: Methods EPL or an LR scheduler may put on the optimizer object itself, which the worker's copy must not call.
_INSTANCE_METHODS = ("step", "zero_grad", "state_dict", "load_state_dict")


class OverlappedHostStep:
    """Defers ``optimizer.step()`` to a worker that updates one block's parameters at a time (see the module doc)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        units: Sequence[nn.Module],
        roots: Sequence[nn.Module],
        timeout: float = STEP_TIMEOUT_S,
    ) -> None:
        self.optimizer = optimizer
        self.timeout = timeout
        #: Each block's own parameters (not those of the blocks below it), in the forward's order; the first part
        #: also holds every parameter no block holds.
        self.parts = _parts(optimizer, units)
        self._index = {id(unit): index for index, unit in enumerate(units)}
        self._worker: ThreadPoolExecutor | None = None
        self._future: Future[None] | None = None
        self._pending: set[int] = set()
        self._done = 0
        self._changed = threading.Condition()
        self._originals = {name: getattr(optimizer, name) for name in _INSTANCE_METHODS}
        for name in _INSTANCE_METHODS:
            replace_method(optimizer, name, getattr(self, f"_{name}"))
        for unit in units:
            unit.register_forward_pre_hook(self._before_block, prepend=True)  # before FSDP2 copies its weights
        for root in roots:
            root.register_forward_hook(self._after_forward)
        defer_reads_until_settled(model, self.settle)

    def __getstate__(self) -> dict[str, Any]:
        """A copy of the model (``copy.deepcopy``) takes no worker and no pending update."""
        self.settle()
        state = self.__dict__.copy()
        state.update(_worker=None, _future=None, _pending=set(), _changed=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _changed=threading.Condition())

    # -- the optimizer's methods -----------------------------------------------------------------------------------
    def _step(self, closure: Callable[[], float] | None = None) -> Any:
        """Start the update on the worker and return (a closure, which must see the update, steps at once)."""
        self.settle()
        if closure is not None:
            return self._originals["step"](closure)
        groups = [_snapshot(group) for group in self.optimizer.param_groups]
        self._pending = {id(p) for group in groups for p in group["params"]}
        self._done = 0
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epl-host-step")
        self._future = self._worker.submit(self._update, groups)
        return None

    def _zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients; those of a pending update are dropped by the worker once it has used them."""
        if self._future is None or not set_to_none:
            self.settle()
            self._originals["zero_grad"](set_to_none)
            return
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                if id(param) not in self._pending:
                    param.grad = None

    def _state_dict(self) -> dict[str, Any]:
        self.settle()
        return self._originals["state_dict"]()

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        self.settle()
        self._originals["load_state_dict"](state)

    # -- the worker and the waits ----------------------------------------------------------------------------------
    def _update(self, groups: list[dict[str, Any]]) -> None:
        """On the worker: step each part with the groups as they were when ``step()`` was called."""
        optimizer = self.optimizer
        shadow = object.__new__(type(optimizer))  # the optimizer's state and defaults, the part's groups
        shadow.__dict__.update({key: value for key, value in vars(optimizer).items() if key not in _INSTANCE_METHODS})
        shadow._optimizer_step_pre_hooks = OrderedDict()  # the user's hooks ran around the call of step()
        shadow._optimizer_step_post_hooks = OrderedDict()
        for index, part in enumerate(self.parts):
            shadow.param_groups = [
                {**group, "params": [p for p in group["params"] if id(p) in part]} for group in groups
            ]
            type(optimizer).step(shadow)
            for group in shadow.param_groups:
                for param in group["params"]:
                    param.grad = None
            with self._changed:
                self._done = index + 1
                self._changed.notify_all()

    def _wait_for(self, parts: int) -> None:
        """Block until the first ``parts`` parts are updated (raise the worker's error; time out naming the step)."""
        future = self._future
        if future is None:
            return
        deadline = time.monotonic() + self.timeout
        with self._changed:
            while self._done < parts and not future.done():
                if not self._changed.wait(timeout=min(1.0, max(deadline - time.monotonic(), 0.0))):
                    if time.monotonic() >= deadline:
                        raise EplError(
                            f"offload.overlap_step: the CPU's optimizer step has not updated block {self._done + 1} "
                            f"of {len(self.parts)} within {self.timeout:.0f} s. The host may "
                            "be overloaded; leave offload.overlap_step off to step before the next forward."
                        )
        if future.done() and future.exception() is not None:
            self.settle()

    def settle(self) -> None:
        """Wait for the pending update, if any (raising its error)."""
        future, self._future = self._future, None
        if future is None:
            return
        try:
            future.result(timeout=self.timeout)
        finally:
            self._pending = set()

    def _before_block(self, module: nn.Module, args: Any) -> None:
        """A block's forward: wait for its parameters and the next block's (whose copy it may post ahead)."""
        if self._future is not None:
            self._wait_for(self._index[id(module)] + 2)

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        """The model's forward ends: every block is updated before any backward (a block the forward skipped too)."""
        self.settle()


def overlap_host_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, units: Sequence[nn.Module], roots: Sequence[nn.Module]
) -> bool:
    """Install :class:`OverlappedHostStep` (its arguments) where the optimizer updates each parameter alone
    (:func:`~epl_memory.optimizer_kinds.updates_each_parameter_alone`); say why not elsewhere."""
    if not updates_each_parameter_alone(optimizer):
        _log.warning(
            "offload.overlap_step: %s is not known to update each parameter from its own gradient and state alone, "
            "so its step runs whole after the backward (overlapped: %s).",
            type(optimizer).__name__,
            known_names(),
        )
        return False
    OverlappedHostStep(model, optimizer, units, roots)
    return True


def _snapshot(group: dict[str, Any]) -> dict[str, Any]:
    """A parameter group's values now (an LR scheduler may change them, tensors in place, before the worker runs)."""
    return {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in group.items()}


def _parts(optimizer: torch.optim.Optimizer, units: Sequence[nn.Module]) -> list[set[int]]:
    """The ids of each unit's own parameters, in ``units``' order; the first part also takes the optimizer's other
    parameters."""
    unit_ids = {id(unit) for unit in units}
    parts: list[set[int]] = []
    for unit in units:
        below = [inner for inner in unit.modules() if inner is not unit and id(inner) in unit_ids]
        theirs = {id(p) for inner in below for p in inner.parameters()}
        parts.append({id(p) for p in unit.parameters() if id(p) not in theirs})
    held = set().union(*parts) if parts else set()
    rest = {id(p) for group in optimizer.param_groups for p in group["params"] if id(p) not in held}
    if parts:
        parts[0] |= rest
    else:
        parts.append(rest)
    return parts
