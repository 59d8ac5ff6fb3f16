"""Memory-efficient AMP (``amp.level = O1``): autocast over float32 weights, and loss scaling.

The model's forward and the loss run under ``torch.autocast`` (float16 on CUDA,
bfloat16 on CPU, or ``amp.dtype``): the operations autocast lists run in low
precision on casts of the float32 weights that live only inside one forward
(autocast's cast cache is cleared when the outermost autocast exits), so no second
copy of the weights is kept between steps. The backward runs outside autocast.

:class:`AmpLossScaler` (epl-core's ``LossScaler``) does what ``torch.amp.GradScaler``
does, for every rank of the job at once: each loss is multiplied by the scale before
its backward; once the gradients are reduced (or just before they are clipped) they
are multiplied by the float32 reciprocal of the scale, noting any inf or NaN; whether
any rank noted one is agreed over the world communicator (ranks of other pipeline
stages or ZeRO partitions hold other gradients), and then every rank skips the
update. EPL's step runners fold that agreement into the core's check of non-finite steps
(``found_nonfinite`` gives this rank's finding, ``record`` takes every rank's verdict: one
all-gather for both); ``update`` agrees on its own. A dynamic scale starts at 2^15, halves
on a skipped step and doubles after ``amp.growth_interval`` consecutive good steps; a fixed
``amp.loss_scale`` never changes.
"""

from __future__ import annotations

import functools
import logging
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from epl.plugin_api import Communicator, ReduceOp, TransformPhase, amp_unscale_, local_tensor

if TYPE_CHECKING:
    from epl.plugin_api import Config, ParallelContext

_log = logging.getLogger("epl.memory")
_WRAPPED = "_epl_autocast_forward"

#: The dynamic loss scale's start (the original EPL's, half of GradScaler's default 2^16).
INIT_SCALE = 2.0**15


@dataclass(frozen=True, kw_only=True)
class AmpPolicy:
    """What the ``amp.*`` keys ask for, on this rank's device."""

    device_type: str
    dtype: torch.dtype
    #: A fixed loss scale, or None for a dynamic one.
    loss_scale: float | None = None
    init_scale: float = INIT_SCALE
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    debug_log: bool = False

    @classmethod
    def from_config(cls, config: Config, device: torch.device) -> AmpPolicy:
        """The policy of ``config``'s ``amp.*`` keys for a model on ``device``."""
        from epl_memory.settings import MemorySettings

        settings = MemorySettings.from_config(config).amp
        name = settings.dtype or ("float16" if device.type == "cuda" else "bfloat16")
        scale = settings.loss_scale
        return cls(
            device_type=device.type,
            dtype=getattr(torch, name),
            loss_scale=None if scale == "dynamic" else float(scale),
            growth_interval=settings.growth_interval,
            debug_log=settings.debug_log,
        )

    @property
    def dynamic(self) -> bool:
        """Whether the loss scale adapts (``amp.loss_scale = "dynamic"``)."""
        return self.loss_scale is None

    def autocast(self) -> torch.autocast:
        """A fresh autocast context for this policy."""
        return torch.autocast(self.device_type, dtype=self.dtype)


def autocast_forward(model: nn.Module, policy: AmpPolicy) -> None:
    """Make ``model.forward`` run under ``policy``'s autocast (idempotent); the weights are not touched."""
    if getattr(model, _WRAPPED, None) is not None:
        return
    original = model.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with policy.autocast():
            return original(*args, **kwargs)

    model.forward = forward
    setattr(model, _WRAPPED, policy)


class Autocast:
    """Model transform (``amp.level = O1``): the forward and the loss of every step run under autocast."""

    name = "amp_autocast"
    phase = TransformPhase.CAST

    def __call__(self, model: nn.Module, context: ParallelContext) -> nn.Module:
        """Wrap ``model.forward`` in autocast and have the step runners enter it around forward and loss."""
        policy = AmpPolicy.from_config(context.config, context.cluster.device)
        autocast_forward(model, policy)
        context.forward_contexts.append(policy.autocast)
        return model


class AmpLossScaler:
    """Loss scaling for every rank of the job (implements epl-core's ``LossScaler``; see the module doc).

    ``scale`` is the current factor, ``skipped_steps`` counts the updates skipped
    for non-finite gradients, ``growth_tracker`` the good steps since the scale last changed.
    """

    def __init__(
        self, policy: AmpPolicy, *, communicator: Communicator | None = None, device: torch.device | None = None
    ) -> None:
        self.policy = policy
        self.communicator = communicator
        self.device = device or torch.device("cpu")
        self._scale = policy.loss_scale if policy.loss_scale is not None else policy.init_scale
        self.growth_tracker = 0
        self.skipped_steps = 0
        self._found: list[torch.Tensor] = []
        self._unscaled = False
        self._scale_tensors: dict[torch.device, torch.Tensor] = {}

    @property
    def scale(self) -> float:
        """The factor losses are multiplied by now."""
        return self._scale

    def start(self) -> None:
        """A step begins: forget what an unfinished step left."""
        self._found = []
        self._unscaled = False

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the scale (a float32 tensor, as GradScaler multiplies)."""
        return loss * self._scale_on(loss.device)

    @torch.no_grad()
    def unscale(self, params: Iterable[nn.Parameter]) -> None:
        """Multiply the existing gradients by the float32 reciprocal of the scale; note inf/NaN (once per step)."""
        if self._unscaled:
            return
        self._unscaled = True
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for param in params:
            grad = param.grad
            if grad is None:
                continue
            grad = local_tensor(grad)  # ZeRO's chunk; the other chunks are their ranks'
            if grad.is_sparse:
                if grad.dtype == torch.float16:
                    param.grad = grad = grad.coalesce()  # duplicate indices summed, as they will be applied
                grad = grad._values()
            groups[grad.device, grad.dtype].append(grad)
        inverse = torch.tensor(1.0 / self._scale, dtype=torch.float32)  # computed in float64, as GradScaler does
        for (device, _), grads in groups.items():
            found = torch.zeros((), dtype=torch.float32, device=device)
            amp_unscale_(grads, found, inverse.to(device))
            self._found.append(found)

    def update(self, params: Iterable[nn.Parameter]) -> bool:
        """Agree with every rank whether a gradient was not finite; adjust the scale; return True to step.

        Unscales first if that has not happened in this step. With more than one process
        this is an all-reduce over the world communicator, so every rank must call it.
        """
        flag = self.found_nonfinite(params).reshape(1)
        if self.communicator is not None and self.communicator.world_size > 1:
            self.communicator.all_reduce(flag, ReduceOp.MAX).wait()
        return self.record(bool(flag.item() == 0))

    @torch.no_grad()
    def found_nonfinite(self, params: Iterable[nn.Parameter]) -> torch.Tensor:
        """This rank's finding alone (no collective, no host sync): a float32 scalar on the device, above 0 when
        one of its gradients was not finite. Unscales first if that has not happened in this step.

        The step runners agree it with every rank (epl-core's ``NonFiniteCheck``), then call :meth:`record`.
        """
        self.unscale(params)
        flag = torch.zeros((), dtype=torch.float32, device=self.device)
        for found in self._found:
            flag += found.to(self.device)
        self.start()
        return flag

    def record(self, finite: bool) -> bool:
        """Adjust the scale by every rank's verdict on this step's gradients (``finite``: none found an inf or
        NaN); return ``finite`` (True: the update is applied)."""
        if not finite:
            self.skipped_steps += 1
            self.growth_tracker = 0
            before = self._scale
            if self.policy.dynamic:
                self._set_scale(self._scale * self.policy.backoff_factor)
            self._debug("AMP: inf/NaN gradient on some rank: update skipped, loss scale %g -> %g", before, self._scale)
            return False
        if self.policy.dynamic:
            self.growth_tracker += 1
            if self.growth_tracker == self.policy.growth_interval:
                self.growth_tracker = 0
                grown = self._scale * self.policy.growth_factor
                if grown <= torch.finfo(torch.float32).max:  # GradScaler keeps the scale if it would overflow
                    self._debug(
                        "AMP: %d steps without inf/NaN: loss scale %g -> %g",
                        self.policy.growth_interval,
                        self._scale,
                        grown,
                    )
                    self._set_scale(grown)
        return True

    def state_dict(self) -> dict[str, Any]:
        """The scale and its counters (plain numbers)."""
        return {"scale": self._scale, "growth_tracker": self.growth_tracker, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; a fixed ``amp.loss_scale`` keeps its configured value."""
        if self.policy.dynamic:
            self._set_scale(float(state["scale"]))
        self.growth_tracker = int(state["growth_tracker"])
        self.skipped_steps = int(state["skipped_steps"])

    def __repr__(self) -> str:
        kind = "dynamic" if self.policy.dynamic else "fixed"
        return f"AmpLossScaler({kind} scale {self._scale:g}, {self.skipped_steps} skipped steps)"

    # -- helpers -------------------------------------------------------------------
    def _scale_on(self, device: torch.device) -> torch.Tensor:
        tensor = self._scale_tensors.get(device)
        if tensor is None:
            tensor = self._scale_tensors[device] = torch.tensor(self._scale, dtype=torch.float32, device=device)
        return tensor

    def _set_scale(self, value: float) -> None:
        self._scale = value
        self._scale_tensors.clear()

    def _debug(self, message: str, *args: Any) -> None:
        if self.policy.debug_log:
            _log.info(message, *args)


def make_loss_scaler(context: ParallelContext) -> AmpLossScaler:
    """The loss scaler of ``context``'s config, agreeing over the world communicator when there are several ranks."""
    policy = AmpPolicy.from_config(context.config, context.cluster.device)
    communicator = context.communicator if context.cluster.world_size > 1 else None
    return AmpLossScaler(policy, communicator=communicator, device=context.cluster.device)
