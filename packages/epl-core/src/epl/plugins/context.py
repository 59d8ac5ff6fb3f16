"""What plugins receive and return when they extend ``epl.parallelize``.

``ParallelContext`` is handed to the model-transform, optimizer-wrapper,
gradient-reducer, loss-scaler and step-runner hooks; the protocols are what those hooks return.
What plugins share travels in typed fields; what a plugin keeps for itself between its
hooks lives in an instance of its own class, :meth:`ParallelContext.state`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import torch
from torch import nn

from epl.annotations.taskgraph import holders_of
from epl.interfaces.collectives import Group, broadcast_tensors, communicators_for
from epl.interfaces.pipeline_placement import PipelinePlacement
from epl.placement.copies import Copies, copies_of, copies_of_shared, every_copy_group

if TYPE_CHECKING:
    from epl.annotations.taskgraph import TaskGraph
    from epl.config import Config
    from epl.context.ring import ContextGroup
    from epl.interfaces.cluster import Cluster
    from epl.interfaces.communicator import Communicator
    from epl.interfaces.nonfinite_verdict import NonFiniteVerdict
    from epl.interfaces.phases import TransformPhase, WrapperPhase
    from epl.interfaces.schedule import ScheduleGenerator
    from epl.interfaces.shard_group import ShardGroup
    from epl.interfaces.split_rule import SplitRule
    from epl.materialize.streaming import StreamedInit
    from epl.placement.plan import Plan

LossFn = Callable[..., torch.Tensor]
State = TypeVar("State")
Fact = TypeVar("Fact")
#: A tensor type (``nn.Parameter``, say): :meth:`ParallelContext.copies_of_tensors` groups what it is given.
TensorT = TypeVar("TensorT", bound=torch.Tensor)


class Registries(Protocol):
    """The registries hooks may consult during ``epl.parallelize`` (the plugin manager is one)."""

    def split_rules(self) -> Mapping[type[nn.Module], SplitRule]:
        """Every registered split rule by module type (``epl_split_rules``)."""
        ...

    def pipeline_schedules(self) -> Mapping[str, ScheduleGenerator]:
        """Every registered pipeline schedule by name (``epl_pipeline_schedules``)."""
        ...

    def config_facts(self, config: Config) -> Mapping[type, object]:
        """Every typed fact the plugins build from ``config`` (``epl_config_facts``), by its type."""
        ...


def facts_of(config: Config, kind: type[Fact], registries: Registries) -> Fact:
    """The record of type ``kind`` (``epl.interfaces.facts``) that its owning plugin built from ``config``, or
    ``kind()``, its defaults, when that plugin is not installed. The records are built once per Config."""
    built = config.derived("facts", lambda: registries.config_facts(config))
    record = built.get(kind)
    return kind() if record is None else record


@dataclass(kw_only=True)
class ParallelContext:
    """Everything ``epl.parallelize`` knows about this rank's part of the job.

    ``model`` is updated after every model transform and ``optimizer`` after
    every wrapper, so later hooks see the result of earlier ones.
    """

    cluster: Cluster
    config: Config
    #: The communicator joining every process of the job.
    communicator: Communicator
    #: The registries of the installed plugins (split rules, pipeline schedules).
    plugins: Registries
    plan: Plan
    taskgraphs: list[TaskGraph]
    model: nn.Module
    loss_fn: LossFn | None
    #: One micro-batch's inputs as ``Engine.step`` takes them, given to ``epl.parallelize(example_inputs=...)``
    #: for the transforms that run the model once (the split layout, pipelines of models fx cannot trace);
    #: None: they guess one from the model (:func:`epl.sharding.dataflow.example_input`).
    example_inputs: Any = None
    #: The model was built on the ``meta`` device: its init units and the job's seed, which give any of its
    #: tensors values (:mod:`epl.materialize`); None: the model was built with values.
    lazy_init: StreamedInit | None = None
    optimizer: torch.optim.Optimizer | None = None
    gradient_reducer: GradientReducer | None = None
    loss_scaler: LossScaler | None = None
    #: Context managers (as factories) that the forward and the loss of a step run inside, e.g. AMP's
    #: autocast (the backward runs outside them). Step runners enter them around the model's call (or
    #: a pipeline stage's part of it) and the loss function; a transform that adds one may also wrap
    #: ``model.forward`` so that other calls of the model (``Engine.predict``) get it too.
    forward_contexts: list[Callable[[], AbstractContextManager[Any]]] = field(default_factory=list)
    #: The step runner ``Engine.step`` calls (set last, from ``epl_make_step_runner``).
    step_runner: StepRunner | None = None
    #: This rank's part of a pipeline (its stages, the modules they run, whether their backward is split), set by
    #: the transform that keeps the stages (epl-pipeline); the defaults without a pipeline: one stage, the whole model.
    pipeline: PipelinePlacement = PipelinePlacement()
    #: The shard group of each split TaskGraph this rank runs, by TaskGraph index (set by the split transform).
    shard_groups: dict[int, ShardGroup] = field(default_factory=dict)
    #: This rank's context group under ``context.degree`` > 1, set by the context transform; None otherwise.
    context_group: ContextGroup | None = None
    #: Tensors a split rule made: id -> (TaskGraph index, whether the tensor is a shard).
    split_tensors: dict[int, tuple[int, bool]] = field(default_factory=dict)
    #: Tensors a split rule made from a tensor several TaskGraphs hold (an embedding tied to the head of another
    #: pipeline stage): id -> the indices of those TaskGraphs, so the shard's copies are every holder's.
    split_holders: dict[int, set[int]] = field(default_factory=dict)
    #: Parameters whose gradients a plugin reduces itself during the backward (epl-memory's ZeRO, on torch's FSDP2),
    #: by id: gradient reducers leave them alone.
    reduced_in_backward: set[int] = field(default_factory=set)
    _states: dict[type, Any] = field(default_factory=dict, repr=False)
    _copy_communicators: dict[Group, Communicator] | None = field(default=None, repr=False)

    def state(self, kind: type[State]) -> State:
        """This parallelize call's instance of a plugin's own state class ``kind``, made (``kind()``) on first use.

        A plugin keeps what its hooks hand each other (a transform to the optimizer wrapper, say) in a
        class of its own, so the state is typed and no two plugins can collide on a name.
        """
        if kind not in self._states:
            self._states[kind] = kind()
        state: State = self._states[kind]  # made by kind()
        return state

    def facts(self, kind: type[Fact]) -> Fact:
        """The typed record ``kind`` (``epl.interfaces.facts``) its owning plugin built from :attr:`config`, or its
        defaults without that plugin (:func:`facts_of`)."""
        return facts_of(self.config, kind, self.plugins)

    def copy_communicators(self) -> dict[Group, Communicator]:
        """This rank's communicator over each group of devices that hold copies of some tensors.

        Made once per ``epl.parallelize`` (on first use, on every rank in the same order) and
        shared by the plugins that need them: data-parallel reduction, ZeRO.
        """
        if self._copy_communicators is None:
            self._copy_communicators = communicators_for(self.communicator, every_copy_group(self.plan))
        return self._copy_communicators

    def agree_with_first_copy(
        self, tensors: Sequence[torch.Tensor], communicator_of: Callable[[Copies], Communicator] | None = None
    ) -> None:
        """Copy the first copy's values of ``tensors`` into every other copy: one broadcast per group of copies (and
        dtype), over ``communicator_of(copies)`` (default: :meth:`copy_communicators`'). A collective of every copy.
        """
        for copies, members in self.copies_of_tensors(tensors).items():
            if len(copies.devices) > 1:
                communicator = communicator_of(copies) if communicator_of else self.copy_communicators()[copies.devices]
                broadcast_tensors(members, communicator)

    def copies_of_tensors(self, tensors: Sequence[TensorT]) -> dict[Copies, list[TensorT]]:
        """``tensors`` of this rank's model, grouped by their copies.

        A tensor is found in the TaskGraph that captured it, or among those a split
        rule made (``split_tensors``); anything else (made by a model transform)
        belongs to the first TaskGraph this rank runs. A tensor several TaskGraphs hold
        (``Plan.shared``: tied weights cut apart by a pipeline partition) has every owner's copies.
        """
        plan, rank = self.plan, self.cluster.rank
        owner = {id(t): (tg.index, False) for tg in self.taskgraphs for t in tg.tensors}
        owner.update(self.split_tensors)
        holders = self.tensor_holders()
        default = (plan.taskgraphs_on(rank)[0], False)
        grouped: dict[Copies, list[TensorT]] = {}
        for tensor in tensors:
            owners = tuple(sorted(holders.get(id(tensor), ())))
            taskgraph, sharded = owner.get(id(tensor), default)
            if owners in plan.shared:
                copies = copies_of_shared(plan, owners, rank, sharded=sharded)
            else:
                copies = copies_of(plan, taskgraph, rank, sharded=sharded)
            grouped.setdefault(copies, []).append(tensor)
        return grouped

    def tensor_holders(self) -> dict[int, set[int]]:
        """``id`` of each tensor of the TaskGraphs, and of each shard a split rule made -> the TaskGraphs holding
        it (several for tied weights a pipeline partition cut apart, sharded or whole)."""
        holders = holders_of(self.taskgraphs)
        holders.update({key: {taskgraph} for key, (taskgraph, _) in self.split_tensors.items()})
        holders.update(self.split_holders)
        return holders

    @property
    def replica_index(self) -> int:
        """The replica this rank belongs to."""
        return 0 if self.plan.local else self.plan.replica_of(self.cluster.rank)

    @property
    def lane_index(self) -> int:
        """The lane this rank belongs to (:class:`~epl.placement.plan.Plan`; its replica without context
        parallelism): tensor and pipeline parallelism run inside it."""
        return 0 if self.plan.local else self.plan.lane_of(self.cluster.rank)


class ModelTransform(Protocol):
    """Changes this rank's model after placement (checkpointing, casting, sharding, sync hooks).

    Transforms run in the order of their ``phase`` (see :class:`epl.interfaces.phases.TransformPhase`),
    then of their ``name``; each receives the previous result.
    """

    name: str
    phase: TransformPhase

    def __call__(self, model: nn.Module, context: ParallelContext) -> nn.Module:
        """Return the transformed model (or ``model`` itself, changed in place)."""
        ...


class OptimizerWrapper(Protocol):
    """Wraps the optimizer (ZeRO partitioning, apply groups, offload).

    Wrappers apply in the order of their ``phase`` (see :class:`epl.interfaces.phases.WrapperPhase`),
    then of their ``name``, each wrapping the previous result.
    """

    name: str
    phase: WrapperPhase

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


@runtime_checkable
class CarriesNonFiniteVerdict(Protocol):
    """A :class:`GradientReducer` that may also decide, for every rank of the job, whether a step's loss and
    gradients were finite (:class:`~epl.runtime.nonfinite.NonFiniteVerdict`): the runner hands it each micro-batch's
    loss before its backward, and reads the verdict after ``finish`` (None: it does not carry one this job)."""

    def observe_loss(self, loss: torch.Tensor) -> None:
        """A micro-batch's loss, before its backward."""
        ...

    def nonfinite_verdict(self) -> NonFiniteVerdict | None:
        """The verdict of the step just finished, or None."""
        ...


class LossScaler(Protocol):
    """Scales the loss before backward and skips updates whose gradients are not finite (mixed precision).

    Step runners call it in the order of :class:`epl.runtime.update.StepUpdate` (where each of
    these calls comes in a step): :meth:`unscale` may come twice in a step (before clipping, and once
    the gradients are complete), the second call doing nothing; the optimizer is applied only when
    :meth:`update` returns True. ``update`` may be a collective: every rank of the job calls it once per step.

    A scaler may instead offer ``found_nonfinite(params) -> Tensor`` (this rank's finding, above 0 when a
    gradient was not finite; no collective) and ``record(finite: bool) -> bool`` (adjust the scale by every
    rank's verdict): EPL's runners then call those in place of ``update``, and the agreement rides the one
    all-gather of their check of non-finite steps (:class:`~epl.runtime.nonfinite.NonFiniteCheck`).
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
    """Runs one training step on this rank: forward, backward and the optimizer update.

    What else a runner may offer is a capability of :mod:`epl.plugins.capabilities` (``EvaluatingRunner``,
    ``PredictingRunner``, ``ClippingRunner``, ...): the engine uses it where ``isinstance`` says the runner has it.
    """

    def step(self, inputs: Any, targets: Any = None) -> torch.Tensor:
        """Train on one replica batch; return the replica's mean loss (detached)."""
        ...
