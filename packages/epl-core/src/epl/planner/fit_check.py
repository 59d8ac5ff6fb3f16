"""The fit check before launch: ``epl.parallelize`` predicts the peak memory of a device of the run and judges it.

:func:`before_launch` runs at ``epl.parallelize``, before the model moves to its device. When the check is on
(``fit_check.enabled``: ``"auto"``, the default, is on where the model trains on an accelerator and off on CPU) it
predicts the peak of the run's most loaded device:

- for a transformers model (one with a ``config``, :meth:`~epl.planner.shape.ModelShape.of`), the planner's
  estimate of the layout the Plan and config make (:func:`~epl.planner.from_plan.layout_of`,
  :func:`~epl.planner.estimate.estimate`): every term of :mod:`epl.planner.memory`, activations included. That
  needs a micro-batch's rows and sequence length: ``fit_check.micro_batch_size`` and
  ``fit_check.sequence_length`` when both are given (the check runs in ``epl.parallelize``); else the first
  ``Engine.step`` runs it on its batch's shape (its ``input_ids``, or first tensor of two dimensions) before the
  forward;
- for any other model, the Plan's estimate of parameters, gradients and optimizer states
  (:mod:`epl.placement.plan_memory`, split shards taken along dimension 0), activations not counted (the
  message says so), in ``epl.parallelize``.

It judges the prediction against the device's memory less :data:`~epl.planner.estimate.RESERVED_BYTES`, as
``epl plan`` does. The device is ``fit_check.device`` (a profile name or JSON file), else the accelerator's memory
as torch reports it with the closest named profile's other figures, else on CPU the host's memory divided among
its processes. When the prediction does not fit, the message gives the peak against the memory, the largest term,
and the cheapest change that fits: each single change of the layout (ZeRO a level up, full checkpointing, smaller
micro-batches and more of them, sequence parallelism under split) is estimated, and the fitting one with the
shortest predicted step is named as EPL config keys; when none fits, the fastest layout ``epl plan --auto`` finds
that fits on the run's devices; when nothing fits, it says so. ``fit_check.action: "warn"`` (the default) logs
it on rank 0 and goes on; ``"refuse"`` raises an :class:`~epl.errors.EplError` on every rank. Every rank predicts
from the same Plan, config and shape, so on a job of like devices they agree without talking.

Cost: the model's shape is read once, at ``epl.parallelize``, before a pipeline cuts the model; one estimate
judges the run; the search runs only when it does not fit (docs/planner.md gives the measured cost).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from epl.config.settings import CoreSettings
from epl.errors import ConfigError, EplError
from epl.interfaces.facts import MemoryTechniques
from epl.placement.plan_memory import OPTIMIZER_STATES, estimate_memory
from epl.placement.render import format_bytes
from epl.planner.apply import known_profile
from epl.planner.devices import PROFILES, DeviceProfile, device_profile, host_memory
from epl.planner.estimate import RESERVED_BYTES, Estimate, estimate
from epl.planner.from_plan import layout_of, precision_of
from epl.planner.layout import ZERO_LEVELS, Layout, Workload
from epl.planner.memory import TERM_MEANINGS
from epl.planner.render import describe_layout
from epl.planner.search import search
from epl.planner.shape import ModelShape
from epl.plugins.facts import config_facts

if TYPE_CHECKING:
    from torch import nn

    from epl.annotations.taskgraph import TaskGraph
    from epl.config import Config
    from epl.interfaces.cluster import Cluster
    from epl.placement.memory_estimate import MemoryEstimate, ShardShapes
    from epl.placement.plan import Plan
    from epl.placement.plan_memory import EstimateHooks, MemoryEstimateContext

logger = logging.getLogger(__name__)

#: Figures of the CPU's profile, which only rank the changes that fit (its memory is the host's).
HOST = DeviceProfile(
    "host", {"fp32": 1e11, "bf16": 1e11, "fp16": 1e11}, 0, intra_node_bandwidth=1e9, inter_node_bandwidth=1e9,
    memory_bandwidth=1e10, overlap=0.5, sources={"memory": "this machine's, shared by its processes"},
)  # fmt: skip
#: The end of every message: the keys that decide what the check does.
KEYS = (
    'fit_check.action: "refuse" stops the run here, "warn" (the default) warns and goes on; '
    "fit_check.enabled: false turns the check off."
)
#: What a prediction without the model's shape leaves out.
NO_ACTIVATIONS = (
    "activations not counted (the model has no transformers `config` to read its shape from): parameters, "
    "gradients and optimizer states only"
)


def enabled(setting: bool | str, device: torch.device) -> bool:
    """Whether ``fit_check.enabled``'s ``setting`` turns the check on for a model trained on ``device``."""
    return device.type != "cpu" if setting == "auto" else bool(setting)


def before_launch(
    model: nn.Module,
    plan: Plan,
    taskgraphs: list[TaskGraph],
    config: Config,
    cluster: Cluster,
    hooks: EstimateHooks,
    optimizer: Any,
    *,
    own_loss: bool,
) -> Callable[[Any], None] | None:
    """Run the fit check of ``model`` placed by ``plan`` at ``epl.parallelize``, before the model moves to its
    device, when it is on and can (module docstring); or return the check the first ``Engine.step`` runs on its
    inputs (None: nothing left to run). ``optimizer``: what ``epl.parallelize`` takes; ``own_loss``: no
    ``loss_fn``, the model computes its loss on whole logits."""
    settings = CoreSettings.from_config(config).fit_check
    if not enabled(settings.enabled, cluster.device):
        return None
    named = device_profile(settings.device) if settings.device else None  # one that is not a profile: an error
    try:
        device = named or device_for(cluster)
        shape = _shape_of(model)
        if shape is None:
            verdict = _plan_verdict(model, plan, taskgraphs, config, hooks, optimizer, device)
        else:
            check = FitCheck(shape, plan, config, device, optimizer_states(optimizer), _sdpa(model), own_loss, cluster)
    except Exception as exc:  # noqa: BLE001 - advisory: a model the check cannot predict still trains
        _cannot(exc, cluster)
        return None
    if shape is None:
        _act(verdict, settings.action, cluster)
        return None
    if settings.micro_batch_size and settings.sequence_length:
        check.run(settings.micro_batch_size, settings.sequence_length)
        return None
    return check.on_batch


@dataclass(frozen=True)
class OptimizerStates:
    """The optimizer's state tensors per parameter, as the planner counts them, and what they were read from."""

    count: int
    what: str


def optimizer_states(optimizer: Any) -> OptimizerStates:
    """The state tensors per parameter of what ``epl.parallelize`` takes as ``optimizer`` (a factory is built over
    one ``meta`` parameter to see its class); Adam's 2 where unknown."""
    if optimizer is None:
        return OptimizerStates(0, "no optimizer")
    built = optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        try:
            built = optimizer([torch.nn.Parameter(torch.empty(1, device="meta"))])
        except Exception:  # noqa: BLE001 - e.g. a factory that names parameter groups: assume Adam
            return OptimizerStates(2, "an optimizer of unknown states (Adam's 2 assumed)")
    name = type(built).__name__
    known = OPTIMIZER_STATES.get(name) if type(built) is getattr(torch.optim, name, None) else None
    if known is None or not isinstance(built, torch.optim.Optimizer):
        return OptimizerStates(2, f"{name} (Adam's 2 states assumed)")
    count = known.tensors(built.defaults)
    return OptimizerStates(count, f"{name} ({count} state{'s' if count != 1 else ''} a parameter)")


class FitCheck:
    """The check of a transformers model's run, its shape read once at ``epl.parallelize``: :meth:`run` for a
    micro-batch's rows and sequence length, :meth:`on_batch` for the first step's batch."""

    def __init__(
        self,
        shape: ModelShape,
        plan: Plan,
        config: Config,
        device: DeviceProfile,
        optimizer: OptimizerStates,
        sdpa: bool,
        own_loss: bool,
        cluster: Cluster,
    ) -> None:
        self.shape, self.device, self.optimizer, self.cluster = shape, device, optimizer, cluster
        self.action = CoreSettings.from_config(config).fit_check.action
        self.micro_batches = plan.num_micro_batch
        self.context = plan.context_degree
        self.presliced = CoreSettings.from_config(config).context.presliced
        # any global batch the replicas and micro-batches divide: run() sets the micro-batch's rows
        self.layout = layout_of(plan, config, plan.world_size * plan.num_micro_batch)
        self.dtype, self.autocast = precision_of(config)
        self.sdpa, self.own_loss = sdpa, own_loss
        self.devices_per_node = plan.gpu_per_worker

    def workload(self, micro_batch_size: int, sequence: int) -> tuple[Layout, Workload]:
        """The layout and workload of micro-batches of ``micro_batch_size`` sequences of ``sequence`` tokens."""
        layout = replace(self.layout, micro_batch_size=micro_batch_size)
        workload = Workload(
            micro_batch_size * layout.micro_batches * layout.data,
            sequence,
            dtype=self.dtype,
            autocast=self.autocast,
            optimizer_states=self.optimizer.count,
            sdpa=self.sdpa,
            devices_per_node=self.devices_per_node,
            gathered_logits=self.own_loss,
        )
        return layout, workload

    def run(self, micro_batch_size: int, sequence: int) -> None:
        """Predict, judge, and warn or refuse (skipped, said at info level, where the planner cannot predict)."""
        try:
            verdict = self.verdict(micro_batch_size, sequence)
        except Exception as exc:  # noqa: BLE001 - advisory: a batch the check cannot predict still trains
            _cannot(exc, self.cluster)
            return
        _act(verdict, self.action, self.cluster)

    def verdict(self, micro_batch_size: int, sequence: int) -> str | None:
        """The message when micro-batches of ``micro_batch_size`` x ``sequence`` tokens do not fit; None when they
        do."""
        layout, workload = self.workload(micro_batch_size, sequence)
        predicted = estimate(self.shape, layout, workload, self.device)
        logger.debug("fit check: predicted peak %s per device of %s", format_bytes(int(predicted.peak)),
                     format_bytes(self.device.memory_bytes))  # fmt: skip
        if predicted.fits:
            return None
        memory = predicted.memory
        where = f" of stage {memory.stage} of {layout.pipeline}" if layout.pipeline > 1 else ""
        assumed = (
            f"Predicted at the {memory.moment}{where}, for micro-batches of {micro_batch_size} x {sequence} tokens, "
            f"{workload.dtype}{' autocast over float32 weights' if workload.autocast else ''}, {self.optimizer.what}."
        )
        return message(memory.terms, self.device, assumed, self.cheapest_change(predicted, workload))

    def cheapest_change(self, current: Estimate, workload: Workload) -> str:
        """The single change of ``current``'s layout that fits with the shortest predicted step; else the fastest
        layout that fits on the run's devices; else that none does."""
        changed = [estimate(self.shape, layout, workload, self.device) for layout in single_changes(current.layout,
                   workload)]  # fmt: skip
        fitting = [e for e in changed if e.fits]
        if fitting:
            # the shortest step (to 3 digits), then the fewest micro-batches
            best = min(fitting, key=lambda e: (float(f"{e.step_time_s:.3g}"), -e.layout.micro_batch_size))
            keys = config_change(current.layout, best.layout)
            micro = (
                f" (micro-batches of {best.layout.micro_batch_size})"
                if best.layout.micro_batch_size != current.layout.micro_batch_size
                else ""
            )
            return (
                f"Cheapest change that fits: with {keys}{micro}: {_of(best.peak, self.device)}, "
                f"a step of {best.step_time_s:.3g} s predicted against {current.step_time_s:.3g} s."
            )
        devices = current.layout.devices
        found = search(self.shape, workload, self.device, devices).plans
        best_plan = found[0] if found else None
        if best_plan is not None and best_plan.fits:
            layout = best_plan.layout
            annotation = f" {layout.annotation()}," if layout.tensor > 1 else ""
            return (
                f"No single change fits; the fastest layout that does on {devices} devices (epl plan --auto) is "
                f"{describe_layout(layout)}:{annotation} config {_keys(layout.config()) or '(none)'}: "
                f"{_of(best_plan.peak, self.device)}."
            )
        closest = ""
        if best_plan is not None:
            closest = f" The closest, {describe_layout(best_plan.layout)}, needs {format_bytes(int(best_plan.peak))}."
        return (
            f"No layout of this model fits {devices} devices of {format_bytes(self.device.memory_bytes)} for this "
            f"batch.{closest} Use more devices, smaller micro-batches or shorter sequences, or devices with more "
            "memory."
        )

    def on_batch(self, inputs: Any) -> None:
        """The check at the first ``Engine.step``, from ``inputs``' shape: rows per micro-batch and sequence length
        of its ``input_ids`` (or first tensor of two dimensions or more); skipped when it has none."""
        from epl.runtime.batch import tensors_in, token_ids

        ids = token_ids(inputs)
        if ids is None:
            ids = next((t for t in tensors_in(inputs) if t.dim() >= 2), None)
        if ids is None:
            logger.debug("fit check skipped: the first batch has no tensor of rows x tokens")
            return
        rows, sequence = ids.shape[0], ids.shape[1] * (self.context if self.presliced else 1)
        self.run(max(1, rows // self.micro_batches), sequence)


def single_changes(layout: Layout, workload: Workload) -> list[Layout]:
    """``layout`` with one setting changed to use less memory: ZeRO a level up (each higher level; with copies to
    shard over), selective or full checkpointing, smaller micro-batches (more of them), sequence parallelism under
    split."""
    changed = []
    if layout.data * layout.context > 1:
        changed += [replace(layout, zero=zero) for zero in ZERO_LEVELS[ZERO_LEVELS.index(layout.zero) + 1 :]]
    if layout.gradient_checkpoint == "none":  # EPL's selective, then whole blocks
        changed += [replace(layout, gradient_checkpoint="ops"), replace(layout, gradient_checkpoint="full")]
    b, m = layout.micro_batch_size, layout.micro_batches
    changed += [replace(layout, micro_batch_size=k, micro_batches=m * b // k) for k in range(1, b) if b % k == 0]
    if (
        layout.tensor > 1
        and not layout.sequence_parallel
        and (workload.sequence // layout.context) % layout.tensor == 0
    ):
        changed.append(replace(layout, sequence_parallel=True))
    return changed


def config_change(current: Layout, changed: Layout) -> str:
    """The config keys (EPL's names, :meth:`Layout.config`) that turn ``current`` into ``changed``."""
    before = current.config()
    return _keys({name: value for name, value in changed.config().items() if before.get(name) != value})


def message(terms: dict[str, float], device: DeviceProfile, assumed: str, change: str) -> str:
    """The warning (or error): the peak against the device's memory, the terms and the largest, the change."""
    peak = sum(terms.values())
    name, size = max(terms.items(), key=lambda item: item[1])
    listed = ", ".join(
        f"{term.replace('_', ' ')} {format_bytes(int(bytes_))}" for term, bytes_ in terms.items() if bytes_
    )
    return (
        f"Fit check: the most loaded device of this run is predicted to peak at {_of(peak, device)} ({device.name}, "
        f"{format_bytes(RESERVED_BYTES)} of it kept for the runtime): it does not fit. Largest term: "
        f"{name.replace('_', ' ')} {format_bytes(int(size))} ({TERM_MEANINGS[name]}); all: {listed}. {assumed} "
        f"{change} {KEYS}"
    )


def device_for(cluster: Cluster) -> DeviceProfile:
    """The device of this rank when ``fit_check.device`` names none: the accelerator's memory as torch reports it,
    with the closest named profile's other figures (by name, else by memory); on CPU the host's memory divided
    among the node's processes."""
    device = cluster.device
    if device.type == "cpu":
        return replace(HOST, memory_bytes=host_memory() // cluster.local_world_size)
    backend: Any = getattr(torch, device.type, None)  # torch.cuda, torch.xpu, ...
    try:
        index = device.index if device.index is not None else backend.current_device()
        properties = backend.get_device_properties(index)
        memory, gpu = int(properties.total_memory), str(properties.name)
    except (AttributeError, RuntimeError, AssertionError) as exc:
        raise EplError(
            f"cannot read the memory of {device} from torch ({exc}): set fit_check.device to a profile name or file"
        ) from exc
    closest = known_profile(gpu, memory) or min(PROFILES.values(), key=lambda p: abs(p.memory_bytes - memory))
    return replace(closest, name=f"{gpu} ({closest.name}'s figures)", memory_bytes=memory)


def _shape_of(model: nn.Module) -> ModelShape | None:
    """``model``'s shape, or None when it has no transformers config the planner reads (a dense decoder)."""
    if getattr(model, "config", None) is None:
        return None
    try:
        shape = ModelShape.of(model)
    except EplError as exc:
        logger.debug("fit check: parameters, gradients and optimizer states only (%s)", exc)
        return None
    return shape


def _sdpa(model: nn.Module) -> bool:
    """Whether the model's attention saves no score matrix (anything but transformers' ``eager``)."""
    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "_attn_implementation", None) != "eager"


def _plan_verdict(
    model: nn.Module,
    plan: Plan,
    taskgraphs: list[TaskGraph],
    config: Config,
    hooks: EstimateHooks,
    optimizer: Any,
    device: DeviceProfile,
) -> str | None:
    """The message when the Plan's parameters, gradients and optimizer states do not fit; None when they do."""
    terms, notes = _plan_terms(model, plan, taskgraphs, config, hooks, optimizer)
    if sum(terms.values()) <= device.memory_bytes - RESERVED_BYTES:
        return None
    change = "No ZeRO level fits either." if plan.world_size > 1 else "It runs on one device: use more devices."
    current = config_facts(config, MemoryTechniques).zero or "none"
    for level in ZERO_LEVELS[ZERO_LEVELS.index(current) + 1 :] if plan.world_size > 1 else ():
        try:
            zero_config = config.with_overrides({"zero.level": level})
        except ConfigError:  # epl-memory not installed
            break
        with_zero, _ = _plan_terms(model, plan, taskgraphs, zero_config, hooks, optimizer)
        if sum(with_zero.values()) <= device.memory_bytes - RESERVED_BYTES:
            change = f'Cheapest change that fits: with zero.level: "{level}": {_of(sum(with_zero.values()), device)}.'
            break
    assumed = f"Predicted from the Plan, {'; '.join((NO_ACTIVATIONS, *notes))}."
    return message(terms, device, assumed, change)


def _plan_terms(
    model: nn.Module, plan: Plan, taskgraphs: list[TaskGraph], config: Config, hooks: EstimateHooks, optimizer: Any
) -> tuple[dict[str, float], tuple[str, ...]]:
    """The most loaded rank's parameters, gradients and optimizer states by the Plan (split shards along dimension
    0, without running the split rules), and the estimate's notes."""
    estimates = estimate_memory(plan, model, taskgraphs, config=config, hooks=_WithoutRules(hooks), optimizer=optimizer)
    worst = max(estimates, key=_total)
    terms = {"parameters": float(worst.parameter_bytes), "gradients": float(worst.gradient_bytes),
             "optimizer": float(worst.optimizer_state_bytes or 0)}  # fmt: skip
    return terms, tuple(note for note in worst.notes if "unknown" in note)


def _total(rank: MemoryEstimate) -> int:
    return rank.parameter_bytes + rank.gradient_bytes + (rank.optimizer_state_bytes or 0)


class _WithoutRules:
    """The plugins' memory adjustments (ZeRO) without their split rules' example forwards: split shards are taken
    along dimension 0, which a fit check's total allows."""

    def __init__(self, hooks: EstimateHooks) -> None:
        self.hooks = hooks

    def estimate_shards(self, model: nn.Module, taskgraphs: list[TaskGraph], plan: Plan) -> ShardShapes | None:
        return None

    def adjust_memory_estimate(self, rank: MemoryEstimate, context: MemoryEstimateContext) -> MemoryEstimate:
        return self.hooks.adjust_memory_estimate(rank, context)


def _act(verdict: str | None, action: str, cluster: Cluster) -> None:
    """Refuse (every rank) or warn (rank 0) with ``verdict``; nothing when it is None (the run fits)."""
    if verdict is None:
        return
    if action == "refuse":
        raise EplError(verdict)
    if cluster.rank == 0:
        logger.warning("%s", verdict)


def _cannot(exc: Exception, cluster: Cluster) -> None:
    """Say on rank 0 why the check did not predict: at info level where the planner says it cannot (an
    :class:`~epl.errors.EplError`), as a warning for anything else (a fault of the check's, to report)."""
    if cluster.rank != 0:
        return
    if isinstance(exc, EplError):
        logger.info("Fit check skipped: %s", exc)
    else:
        logger.warning("Fit check skipped: it failed (%s: %s); the run goes on. Report it to EPL.", type(exc).__name__,
                       exc)  # fmt: skip


def _of(peak: float, device: DeviceProfile) -> str:
    return f"{format_bytes(int(peak))} of {format_bytes(device.memory_bytes)}"


def _keys(config: dict[str, Any]) -> str:
    """``zero.level: "v1", pipeline.num_micro_batch: 8``."""
    return ", ".join(f"{name}: {_value(value)}" for name, value in config.items())


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else str(value)
