"""What plugins receive and return when they extend ``epl.parallelize``.

``ParallelContext`` is handed to the model-transform, optimizer-wrapper,
gradient-reducer, loss-scaler and step-runner hooks; the protocols are what those hooks return.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from epl.cluster import Cluster
    from epl.comm.protocol import Communicator
    from epl.config import Config
    from epl.env import Env
    from epl.placement.plan import Plan
    from epl.strategy.taskgraph import TaskGraph

LossFn = Callable[..., torch.Tensor]


@dataclass(kw_only=True)
class ParallelContext:
    """Everything ``epl.parallelize`` knows about this rank's part of the job.

    ``model`` is updated after every model transform and ``optimizer`` after
    every wrapper, so later hooks see the result of earlier ones.
    """

    env: Env
    plan: Plan
    taskgraphs: list[TaskGraph]
    model: nn.Module
    loss_fn: LossFn | None
    optimizer: torch.optim.Optimizer | None = None
    gradient_reducer: GradientReducer | None = None
    loss_scaler: LossScaler | None = None
    #: Context managers (as factories) that the forward and the loss of a step run inside, e.g. AMP's
    #: autocast (the backward runs outside them). Step runners enter them around the model's call (or
    #: a pipeline stage's part of it) and the loss function; a transform that adds one may also wrap
    #: ``model.forward`` so that other calls of the model (``Engine.predict``) get it too.
    forward_contexts: list[Callable[[], AbstractContextManager[Any]]] = field(default_factory=list)
    #: Tensors a split rule made: id -> (TaskGraph index, whether the tensor is a shard).
    split_tensors: dict[int, tuple[int, bool]] = field(default_factory=dict)
    #: Parameters whose reduced gradient only one copy keeps (ZeRO v1/v2): id -> that copy's rank in the
    #: communicator over the parameter's copies. Gradient reducers leave the others' gradient at None.
    gradient_owners: dict[int, int] = field(default_factory=dict)
    #: State plugins share between their hooks for this parallelize call, keyed by plugin name.
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def config(self) -> Config:
        """The validated config."""
        return self.env.config

    @property
    def cluster(self) -> Cluster:
        """This process's place in the job."""
        return self.env.cluster

    @property
    def communicator(self) -> Communicator:
        """The communicator joining every process of the job."""
        assert self.env.communicator is not None, "a plan-only run has no communicator"
        return self.env.communicator

    @property
    def replica_index(self) -> int:
        """The replica this rank belongs to."""
        return 0 if self.plan.local else self.plan.replica_of(self.cluster.rank)


class ModelTransform(Protocol):
    """Changes this rank's model after placement (checkpointing, casting, sharding, sync hooks).

    Transforms run in ascending ``order``; each receives the previous result.
    """

    name: str
    order: int

    def __call__(self, model: nn.Module, context: ParallelContext) -> nn.Module:
        """Return the transformed model (or ``model`` itself, changed in place)."""
        ...


class OptimizerWrapper(Protocol):
    """Wraps the optimizer (ZeRO partitioning, apply groups, loss scaling, gradient sync)."""

    name: str
    order: int

    def __call__(self, optimizer: torch.optim.Optimizer, context: ParallelContext) -> torch.optim.Optimizer:
        """Return the wrapped optimizer."""
        ...


class GradientReducer(Protocol):
    """Combines the gradients of the copies of this rank's parameters (data parallelism).

    It may start reducing during backward (e.g. from gradient hooks). The step runner
    calls :meth:`start` at the beginning of every step and :meth:`finish` after its
    last backward, before the update; a backward outside a step is not reduced.
    """

    def start(self) -> None:
        """A step begins: forget whatever an earlier, unfinished step or a stray backward left."""
        ...

    def finish(self, clip: Callable[[], None] | None) -> None:
        """Complete this step's reduction; call ``clip`` (local clipping) before or after it, as configured."""
        ...


class LossScaler(Protocol):
    """Scales the loss before backward and skips updates whose gradients are not finite (mixed precision).

    In every step the runner calls :meth:`start`, then :meth:`scale_loss` on each
    micro-batch's loss before its backward, then :meth:`unscale` once the gradients are
    complete (after the gradient reducer's ``finish``, or just before local clipping when
    that comes first; a second call in the same step does nothing), then :meth:`update`,
    and applies the optimizer only when ``update`` returns True. ``update`` may be a
    collective: every rank of the job calls it once per step.
    """

    @property
    def scale(self) -> float:
        """The factor losses are multiplied by now."""
        ...

    def start(self) -> None:
        """A step begins: forget what an earlier, unfinished step left."""
        ...

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` multiplied by the scale, to call ``backward`` on."""
        ...

    def unscale(self, params: Iterable[nn.Parameter]) -> None:
        """Divide the gradients of ``params`` (those that exist) by the scale and note any non-finite value."""
        ...

    def update(self, params: Iterable[nn.Parameter]) -> bool:
        """Decide with every rank whether this step's gradients are finite, adjust the scale; True: apply the step."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (the scale and its counters)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        ...


class StepRunner(Protocol):
    """Runs one training step on this rank: forward, backward and the optimizer update."""

    def step(self, inputs: Any, targets: Any = None) -> torch.Tensor:
        """Train on one replica batch; return the replica's mean loss (detached)."""
        ...
