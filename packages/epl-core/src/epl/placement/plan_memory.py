"""Memory per rank estimated from the Plan, without running: parameters, gradients, optimizer states.

The estimate is what :meth:`Engine.memory_report` counts after a training step,
computed from the model's parameters and the Plan instead of from a run's tensors:

* parameters: the parameters of the TaskGraphs each rank runs. The shards of a
  split TaskGraph's modules come from the ``epl_estimate_shards`` hook (the core's
  tensor parallelism answers it by running its split rules on ``meta`` copies, so
  each shard has the size the run gives it and nothing is allocated). Where no
  plugin answers or a rule cannot run here, each parameter is sharded along
  dimension 0 (the larger shards first) and a note says so. Where the run would
  fail (an :class:`~epl.errors.EplError`: a module no rule covers, sizes that do
  not divide), the estimate fails with the run's error. The Plan's
  ``TaskGraphSpec.shards`` list what each device holds (:mod:`epl.placement.shards`).
* gradients: the bytes of the parameters that require grad.
* optimizer states: from the optimizer's class and each parameter group's options,
  by :data:`OPTIMIZER_STATES`: how many state tensors the size of the parameter it
  keeps for each parameter that requires grad (every parameter it holds, for one
  that makes its state when built: Adagrad). 0-dim states (Adam's step counter)
  are left out, as ``memory_report`` leaves them out. A class not in the table gives
  ``None`` (unknown); a subclass is not assumed to keep its base class's state.

Activations are not estimated: ``Engine.memory_report(inputs, targets)`` measures them.

This module runs no plugin code of its own: it is handed the hooks (:class:`EstimateHooks`,
the plugin manager in a run). The core knows no memory technique. Each rank's estimate goes through the
``epl_adjust_memory_estimate`` hook, whose implementations (e.g. epl-memory's ZeRO)
return an adjusted estimate in turn, from :class:`MemoryEstimateContext`: the
tensors the rank holds and the copies of each.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

from epl.errors import EplError
from epl.placement.memory_estimate import EstimatedTensor, MemoryEstimate, ShardPieces, ShardShapes
from epl.placement.shards import ShardRow, summarise

if TYPE_CHECKING:
    import torch
    from torch import nn

    from epl.annotations.taskgraph import TaskGraph
    from epl.config import Config
    from epl.placement.copies import Copies
    from epl.placement.plan import Plan, TaskGraphSpec


class EstimateHooks(Protocol):
    """The hooks an estimate asks (the plugin manager answers them in a run)."""

    def estimate_shards(self, model: nn.Module, taskgraphs: list[TaskGraph], plan: Plan) -> ShardShapes | None:
        """The shards of the split TaskGraphs ``taskgraphs`` (``epl_estimate_shards``), or None."""
        ...

    def adjust_memory_estimate(self, estimate: MemoryEstimate, context: MemoryEstimateContext) -> MemoryEstimate:
        """``estimate`` after every plugin's adjustment (``epl_adjust_memory_estimate``)."""
        ...


@dataclass(frozen=True)
class MemoryEstimateContext:
    """What ``epl_adjust_memory_estimate`` receives besides the estimate: the rank and what it holds."""

    plan: Plan
    config: Config
    rank: int
    #: The parameters the rank holds, in the order of the rank's ``model.parameters()``.
    tensors: tuple[EstimatedTensor, ...]
    #: The optimizer's class name; None without an optimizer.
    optimizer: str | None
    #: Copies by (TaskGraph, sharded, slot), shared by the ranks of one estimate.
    _copies: dict[tuple[int, bool, int], Copies] = field(default_factory=dict, compare=False, repr=False)

    def copies(self, tensor: EstimatedTensor) -> Copies:
        """The devices holding copies of ``tensor`` (what data parallelism reduces over)."""
        from epl.placement.copies import copies_of

        # The copies of a TaskGraph's tensors depend on the device's slot in its replica only.
        key = (tensor.taskgraph, tensor.sharded, self.plan.locate(self.rank)[1])
        if key not in self._copies:
            self._copies[key] = copies_of(self.plan, tensor.taskgraph, self.rank, sharded=tensor.sharded)
        return self._copies[key]


@dataclass(frozen=True)
class OptimizerStates:
    """The state a ``torch.optim`` class keeps per parameter, from its parameter group's options."""

    #: How many state tensors of the parameter's shape and dtype (0-dim ones are not counted).
    tensors: Callable[[Mapping[str, Any]], int]
    #: What it keeps, for notes.
    doc: str = ""
    #: Made when the optimizer is built, for every parameter (frozen ones too), not at its first step.
    eager: bool = False


def _adam(options: Mapping[str, Any]) -> int:
    return 3 if options.get("amsgrad") else 2


def _rmsprop(options: Mapping[str, Any]) -> int:
    return 1 + bool(options.get("momentum")) + bool(options.get("centered"))


def _two(options: Mapping[str, Any]) -> int:
    return 2


def _one(options: Mapping[str, Any]) -> int:
    return 1


#: torch.optim class name -> the state tensors it keeps per parameter (the tests check them against torch).
OPTIMIZER_STATES: dict[str, OptimizerStates] = {
    "SGD": OptimizerStates(lambda o: 1 if o.get("momentum") else 0, "a momentum buffer (with momentum != 0)"),
    "Adam": OptimizerStates(_adam, "exp_avg, exp_avg_sq (and max_exp_avg_sq with amsgrad)"),
    "AdamW": OptimizerStates(_adam, "exp_avg, exp_avg_sq (and max_exp_avg_sq with amsgrad)"),
    "Adamax": OptimizerStates(_two, "exp_avg, exp_inf"),
    "NAdam": OptimizerStates(_two, "exp_avg, exp_avg_sq"),
    "RAdam": OptimizerStates(_two, "exp_avg, exp_avg_sq"),
    "Adagrad": OptimizerStates(_one, "sum", eager=True),
    "Adadelta": OptimizerStates(_two, "square_avg, acc_delta"),
    "RMSprop": OptimizerStates(_rmsprop, "square_avg (and momentum_buffer with momentum, grad_avg when centered)"),
    "Rprop": OptimizerStates(_two, "prev, step_size"),
    "ASGD": OptimizerStates(_one, "ax"),
}


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The ``torch.optim`` class of :data:`OPTIMIZER_STATES` called ``name`` (any case)."""
    import torch

    from epl.errors import EplError

    for known in OPTIMIZER_STATES:
        if known.lower() == name.lower():
            return cast("type[torch.optim.Optimizer]", getattr(torch.optim, known))
    raise EplError(f"No optimizer {name!r} to estimate with; known: {', '.join(OPTIMIZER_STATES)}.")


def with_memory(
    plan: Plan,
    model: nn.Module,
    taskgraphs: list[TaskGraph],
    *,
    config: Config,
    hooks: EstimateHooks,
    optimizer: Any = None,
) -> Plan:
    """``plan`` with :attr:`Plan.memory` (see :func:`estimate_memory`).

    The split TaskGraphs' shard sizes (``TaskGraphSpec.shard_parameters``/``shard_bytes``,
    estimated along dimension 0 when the Plan is built) become those of their split rules,
    and ``TaskGraphSpec.shards`` lists what each of their devices holds. Raises the
    :class:`~epl.errors.EplError` the run would raise when a split TaskGraph cannot be split.
    """
    from dataclasses import replace

    memory, holdings = _estimate(plan, model, taskgraphs, config=config, hooks=hooks, optimizer=optimizer)
    specs = tuple(holdings.refined(tg) if tg.index in holdings.split else tg for tg in plan.taskgraphs)
    return replace(plan, taskgraphs=specs, memory=memory)


def estimate_memory(
    plan: Plan,
    model: nn.Module,
    taskgraphs: list[TaskGraph],
    *,
    config: Config,
    hooks: EstimateHooks,
    optimizer: Any = None,
) -> tuple[MemoryEstimate, ...]:
    """Each rank's estimate (index = rank) for ``model`` placed by ``plan``, adjusted by the plugins.

    ``optimizer`` is what ``epl.parallelize`` takes: None, an optimizer built over
    ``model``'s parameters, or a factory ``params -> Optimizer`` (a ``torch.optim``
    class is one). A factory is called once, on ``meta`` copies of the parameters.
    """
    return _estimate(plan, model, taskgraphs, config=config, hooks=hooks, optimizer=optimizer)[0]


def _estimate(
    plan: Plan,
    model: nn.Module,
    taskgraphs: list[TaskGraph],
    *,
    config: Config,
    hooks: EstimateHooks,
    optimizer: Any,
) -> tuple[tuple[MemoryEstimate, ...], _Holdings]:
    view = _OptimizerView.of(optimizer, model)
    holdings = _Holdings(plan, model, taskgraphs, hooks, view)
    holdings.check_local()
    copies: dict[tuple[int, bool, int], Copies] = {}
    estimates = []
    for rank in range(plan.world_size):
        tensors, notes = holdings.of(rank)
        states = [t.state_bytes for t in tensors]
        base = MemoryEstimate(
            rank=rank,
            parameter_bytes=sum(t.bytes for t in tensors),
            gradient_bytes=sum(t.gradient_bytes for t in tensors),
            optimizer_state_bytes=None if None in states else sum(cast("list[int]", states)),
            notes=(*view.notes, *notes),
        )
        context = MemoryEstimateContext(
            plan=plan, config=config, rank=rank, tensors=tensors, optimizer=view.name, _copies=copies
        )
        estimates.append(hooks.adjust_memory_estimate(base, context))
    return tuple(estimates), holdings


# -- the optimizer -------------------------------------------------------------------------


@dataclass
class _OptimizerView:
    """The optimizer's class and the options of the group of each parameter of the model."""

    name: str | None = None
    states: OptimizerStates | None = None
    #: id(model parameter) -> its group's options.
    groups: dict[int, Mapping[str, Any]] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    @classmethod
    def of(cls, optimizer: Any, model: nn.Module) -> _OptimizerView:
        import torch
        from torch import nn
        from torch.nn.parameter import is_lazy

        from epl.interfaces.optimizer_groups import group_options

        if optimizer is None:
            return cls(notes=("no optimizer: no optimizer states",))
        params = [p for p in model.parameters() if not is_lazy(p)]
        if isinstance(optimizer, torch.optim.Optimizer):
            built, stand_ins = optimizer, params
        else:
            stand_ins = [
                nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad) for p in params
            ]
            try:
                built = optimizer(stand_ins)
            except Exception:  # noqa: BLE001 - e.g. fused=True refuses meta tensors: build over the real ones
                try:
                    built, stand_ins = optimizer(params), params
                except Exception as exc:  # noqa: BLE001 - the run would fail too; the plan says why
                    return cls(notes=(f"optimizer states unknown: the optimizer factory failed ({exc})",))
            if not isinstance(built, torch.optim.Optimizer):
                return cls(notes=(f"optimizer states unknown: the factory returned {type(built).__name__}",))
        name = type(built).__name__
        states = OPTIMIZER_STATES.get(name) if type(built) is getattr(torch.optim, name, None) else None
        original = {id(s): p for s, p in zip(stand_ins, params, strict=True)}
        groups: dict[int, Mapping[str, Any]] = {}
        for group in built.param_groups:
            options = group_options(group)
            for param in group["params"]:
                if id(param) in original:
                    groups.setdefault(id(original[id(param)]), options)
        if states is None:
            note = f"optimizer states unknown: {name} is not in epl.placement.plan_memory.OPTIMIZER_STATES"
        else:
            note = f"optimizer states: {name} keeps {states.doc} per parameter (0-dim step counters not counted)"
        return cls(name=name, states=states, groups=groups, notes=(note,))

    def state_bytes(self, original: nn.Parameter, tensor: torch.Tensor) -> int | None:
        """Bytes of the state tensors kept for ``tensor`` (``original`` or its shard); None: unknown."""
        options = self.groups.get(id(original))
        if options is None:
            return 0
        if self.states is None:
            return None
        if not tensor.requires_grad and not self.states.eager:  # never given a gradient: never stepped
            return 0
        return self.states.tensors(options) * tensor.numel() * tensor.element_size()


# -- what each rank holds ------------------------------------------------------------------


class _Holdings:
    """The parameters each rank holds, computed once per set of (TaskGraph, position) it runs."""

    def __init__(
        self, plan: Plan, model: nn.Module, taskgraphs: list[TaskGraph], hooks: EstimateHooks, view: _OptimizerView
    ) -> None:
        from torch.nn.parameter import is_lazy

        self.plan, self.model, self.view, self.hooks = plan, model, view, hooks
        self.owner = {id(t): tg.index for tg in taskgraphs for t in tg.tensors}
        self.params = [(name, p) for name, p in model.named_parameters() if not is_lazy(p)]
        self.split_taskgraphs = [tg for tg in taskgraphs if tg.strategy.kind == "split"]
        self.split = {tg.index: tg for tg in self.split_taskgraphs} if not plan.local else {}
        self._shapes: ShardShapes | None = None
        self._cache: dict[tuple[tuple[int, int], ...], tuple[tuple[EstimatedTensor, ...], tuple[str, ...]]] = {}
        self._shard_cache: dict[tuple[int, int], tuple[dict[int, tuple[int, ShardPieces]], str | None]] = {}

    def of(self, rank: int) -> tuple[tuple[EstimatedTensor, ...], tuple[str, ...]]:
        """The tensors ``rank`` holds, in its model's order, and notes on how they were estimated."""
        held = self.plan.assignment(rank).taskgraphs
        if held not in self._cache:
            self._cache[held] = self._compute(dict(held))
        return self._cache[held]

    def _compute(self, positions: dict[int, int]) -> tuple[tuple[EstimatedTensor, ...], tuple[str, ...]]:
        notes: list[str] = []
        shards = {index: self._shards(index, positions[index], notes) for index in self.split if index in positions}
        rows: list[EstimatedTensor] = []
        emitted: set[int] = set()
        for name, param in self.params:
            taskgraph = self.owner.get(id(param), 0)
            if taskgraph not in positions:
                continue
            replaced = shards.get(taskgraph, {}).get(id(param))
            if replaced is None:
                rows.append(self._row(name, param, param, taskgraph, sharded=False))
                continue
            key, pieces = replaced  # the shard module takes the place of its module: its parameters, in order
            if key not in emitted:
                emitted.add(key)
                rows += [self._row(n, param, piece, taskgraph, sharded) for n, piece, sharded in pieces]
        return tuple(rows), tuple(notes)

    def _row(
        self, name: str, original: nn.Parameter, tensor: torch.Tensor, taskgraph: int, sharded: bool
    ) -> EstimatedTensor:
        return EstimatedTensor(
            name=name,
            taskgraph=taskgraph,
            numel=tensor.numel(),
            element_size=tensor.element_size(),
            requires_grad=tensor.requires_grad,
            sharded=sharded,
            state_bytes=self.view.state_bytes(original, tensor),
            rows=tensor.shape[0] if tensor.dim() else 1,
        )

    # -- split TaskGraphs ------------------------------------------------------------------
    def check_local(self) -> None:
        """In a one-process Plan, have the split TaskGraphs' shards worked out: it fails where the run would.

        Nothing is sharded in one process, but the run still looks up a rule for every module
        (the core's answer to ``epl_estimate_shards`` does, as it is built).
        """
        if self.plan.local and self.split_taskgraphs:
            self.hooks.estimate_shards(self.model, self.split_taskgraphs, self.plan)

    def refined(self, spec: TaskGraphSpec) -> TaskGraphSpec:
        """``spec`` of a split TaskGraph with each position's shards as its split rules make them."""
        from dataclasses import replace

        positions = range(self.split[spec.index].strategy.device_count)
        held = [self._held(spec.index, position) for position in positions]
        return replace(
            spec,
            shard_parameters=tuple(sum(p.numel() for _, p, _ in pieces) for pieces in held),
            shard_bytes=tuple(sum(p.numel() * p.element_size() for _, p, _ in pieces) for pieces in held),
            shards=tuple(self._rows(pieces) for pieces in held),
        )

    def _held(self, index: int, position: int) -> ShardPieces:
        """The parameters of every shard module at ``position`` of split TaskGraph ``index``, in order."""
        shards = {key: pieces for key, pieces in self._shards(index, position, []).values()}
        return [piece for pieces in shards.values() for piece in pieces]

    @functools.cached_property
    def wholes(self) -> dict[str, ShardRow]:
        """Parameter name (tied ones under each name) -> the parameter as a row: whole, its module, other names."""
        from torch.nn.parameter import is_lazy

        named = [(n, p) for n, p in self.model.named_parameters(remove_duplicate=False) if not is_lazy(p)]
        names: dict[int, list[str]] = {}
        for name, param in named:
            names.setdefault(id(param), []).append(name)
        return {
            name: ShardRow(
                name=name,
                module=type(self.model.get_submodule(name.rpartition(".")[0])).__name__,
                shape=tuple(param.shape),
                whole=tuple(param.shape),
                sharded=False,
                tied=tuple(other for other in names[id(param)] if other != name),
            )
            for name, param in named
        }

    def _rows(self, pieces: ShardPieces) -> tuple[ShardRow, ...]:
        from dataclasses import replace

        unknown = ShardRow(name="", module="", shape=(), whole=None, sharded=False)
        because: dict[str, str] = getattr(self._shapes, "whole_because", None) or {}

        def why(name: str) -> str:
            module = name.rpartition(".")[0]
            while module not in because and module:
                module = module.rpartition(".")[0]
            return because.get(module, "")

        return summarise(
            replace(
                self.wholes.get(name, unknown),
                name=name,
                shape=tuple(piece.shape),
                sharded=sharded,
                why="" if sharded else why(name),
            )
            for name, piece, sharded in pieces
        )

    def _shards(self, index: int, position: int, notes: list[str]) -> dict[int, tuple[int, ShardPieces]]:
        """id(parameter) -> (its module, the shard's parameters) at ``position`` of split TaskGraph ``index``."""
        if (index, position) not in self._shard_cache:
            taskgraph = self.split[index]
            count = taskgraph.strategy.device_count
            try:
                if self._shapes is None:
                    self._shapes = self.hooks.estimate_shards(self.model, list(self.split.values()), self.plan)
                if self._shapes is None:
                    raise LookupError("no installed plugin estimates the shards of split TaskGraphs")
                self._shard_cache[index, position] = dict(self._shapes.pieces(index, position)), None
            except EplError:
                raise  # the run would fail the same way (a module no rule covers, sizes that do not divide)
            except Exception as exc:  # noqa: BLE001 - a rule that needs the devices: estimate along dimension 0
                why = (
                    f"{taskgraph.name}: parameters sharded along dimension 0 as an estimate "
                    f"(its split rules could not run without the devices: {exc})"
                )
                self._shard_cache[index, position] = self._along_dim0(taskgraph, position, count), why
        shards, note = self._shard_cache[index, position]
        if note:
            notes.append(note)
        return shards

    def _along_dim0(self, taskgraph: TaskGraph, position: int, count: int) -> dict[int, tuple[int, ShardPieces]]:
        import torch

        from epl.interfaces.shard_group import shard_sizes

        names = {id(p): name for name, p in self.params}
        found: dict[int, tuple[int, ShardPieces]] = {}
        for key, param in enumerate(taskgraph.parameters):
            if id(param) in names:
                shape = (shard_sizes(param.shape[0], count)[position], *param.shape[1:]) if param.dim() else ()
                piece = torch.empty(shape, dtype=param.dtype, device="meta").requires_grad_(param.requires_grad)
                found[id(param)] = (-1 - key, [(names[id(param)], piece, True)])
        return found
