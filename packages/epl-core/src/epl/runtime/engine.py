"""``Engine``: what ``epl.parallelize`` returns and a training loop calls."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from epl.config.settings import CoreSettings
from epl.placement.plan import Plan
from epl.plugins.capabilities import (
    ChecksNonFiniteSteps,
    ClippingRunner,
    CountsSkippedSteps,
    EvaluatingRunner,
    MeasurableRunner,
    PredictingRunner,
    SharingRunner,
)
from epl.plugins.context import LossScaler, ParallelContext, StepRunner
from epl.runtime.batch import call_model, samples_and_tokens, tensors_in, to_device
from epl.runtime.memory import MemoryReport
from epl.runtime.nonfinite import NonFiniteCheck, StepOutcome
from epl.sharding.data_shards import settle_pending_update

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler

    from epl.compiling import CompileReport
    from epl.runtime.batch_check import BatchCheck
    from epl.runtime.checkpoint import CheckpointSave
    from epl.runtime.vocabulary_check import VocabularyCheck

_log = logging.getLogger(__name__)

#: Version of the layout of ``Engine.state_dict``.
STATE_VERSION = 1


class Engine:
    """Trains this rank's part of the model as the Plan says.

    ``step(inputs, targets)`` takes the batch of this rank's replica and returns
    the replica's mean loss. ``num_replicas`` and ``replica_index`` tell a script
    which share of the data is its own.
    """

    #: Version of the layout of ``Engine.state_dict`` (what :meth:`load_state_dict` reads).
    STATE_VERSION: ClassVar[int] = STATE_VERSION

    def __init__(self, context: ParallelContext, runner: StepRunner) -> None:
        self.context = context
        """Everything ``epl.parallelize`` built for this rank (:class:`epl.plugin_api.ParallelContext`): the config,
        the plan, the split TaskGraphs' groups (``context.shard_groups``) and the plugins' state
        (``context.state(...)``)."""
        self.runner = runner
        _check_skips_are_seen(runner, context.loss_scaler)
        self.global_step = 0
        """Steps trained so far: one per :meth:`step` that returned. :meth:`save` records it and :meth:`load`
        restores it, so a resumed script finds its place from it (``epoch = engine.global_step // len(loader)``)."""
        self._lr_scheduler: LRScheduler | None = None
        #: Samples and tokens of the last step's replica batch (see :attr:`last_step_samples`).
        self._last_batch: tuple[int | None, int | None] = (None, None)
        #: Compares each step's batch over the ranks of this replica (``io.check_batches``; None: not checked).
        self.batch_check: BatchCheck | None = None
        #: Checks the batch's token ids and labels on every pipeline stage (split stages; None: the split modules do).
        self.vocabulary_check: VocabularyCheck | None = None
        #: The fit check the first step runs on its inputs (:mod:`epl.planner.fit_check`; None: none left to run).
        self.fit_check: Callable[[Any], None] | None = None
        #: The checkpoint ``save(asynchronous=True)`` is writing (None once seen done by a step).
        self._pending_save: CheckpointSave | None = None
        self._skipped = 0  # see skipped_steps
        #: The skipped steps in a row up to the last step (0: its update was applied), and where that run began.
        self._skips_in_a_row = 0
        self._first_skip: tuple[int, StepOutcome | None] | None = None

    # -- training --------------------------------------------------------------------
    def step(self, inputs: Any, targets: Any = None) -> torch.Tensor:
        """Run forward, backward and the optimizer on one replica batch; return its mean loss.

        When any rank's loss or gradients are NaN or Inf (AMP's overflows included), every rank skips the update:
        the weights and the optimizer's state stay as they were, the gradients are dropped, and
        :attr:`skipped_steps` counts it. :attr:`global_step` counts every call, skipped or not (it numbers the
        batches, as torchtitan's and DeepSpeed's step counters do). After ``optimizer.raise_after_skips`` skipped
        steps in a row, ``step`` raises an :class:`~epl.errors.EplError` naming where they began.

        The LR scheduler (if any) steps after every update the optimizer made, not after a skipped one.
        ``ReduceLROnPlateau`` needs a metric: step it yourself (``engine.lr_scheduler.step(validation_loss)``).
        """
        if self._pending_save is not None and self._pending_save.done():
            pending, self._pending_save = self._pending_save, None
            pending.surface()  # the error of a checkpoint written in the background, if nobody saw it yet
        if self.fit_check is not None:  # once, before the first forward
            fit_check, self.fit_check = self.fit_check, None
            fit_check(inputs)
        skipped_before = self._skipped_updates()
        nonfinite = _nonfinite_check(self.runner)
        if nonfinite is not None:
            nonfinite.last = None
        check = (
            self.batch_check if self.batch_check is not None and self.batch_check.due(self.global_step + 1) else None
        )
        if check is not None:  # before the forward: its collectives crash on batches of different sizes
            check.start(inputs, targets, self.global_step + 1)
        if self.vocabulary_check is not None:
            self.vocabulary_check(inputs, targets)
        loss = self.runner.step(inputs, targets)
        self.global_step += 1
        self._last_batch = samples_and_tokens(inputs)
        outcome = nonfinite.last if nonfinite is not None else None
        applied = outcome.applied if outcome is not None else self._skipped_updates() == skipped_before
        scheduler = self._lr_scheduler
        if scheduler is not None and applied and not _needs_metric(scheduler):
            scheduler.step()
        if applied:
            self._skips_in_a_row, self._first_skip = 0, None
        else:
            self._count_skip(outcome)
        return loss

    def _skipped_updates(self) -> int:
        """The loss scaler's count of skipped updates: how a runner without a ``NonFiniteCheck`` tells of a skip."""
        scaler = self.loss_scaler
        return int(scaler.skipped_steps) if isinstance(scaler, CountsSkippedSteps) else 0

    def _count_skip(self, outcome: StepOutcome | None) -> None:
        """Count the step just skipped; warn on rank 0; raise after ``optimizer.raise_after_skips`` in a row."""
        from epl.errors import EplError

        self._skipped += 1
        self._skips_in_a_row += 1
        if self._first_skip is None:
            self._first_skip = (self.global_step, outcome)
        what = "a gradient (found by the loss scaler)" if outcome is None else outcome.describe()
        if self.context.cluster.rank == 0 and (outcome is None or outcome.loss_ranks or self.loss_scaler is None):
            _log.warning(
                "Step %d skipped on every rank: NaN or Inf in %s (%d skipped so far).",
                self.global_step,
                what,
                self._skipped,
            )
        limit = CoreSettings.from_config(self.context.config).optimizer.raise_after_skips
        if limit is None or self._skips_in_a_row < limit:
            return
        assert self._first_skip is not None
        first, first_outcome = self._first_skip
        began = "a gradient (found by the loss scaler)" if first_outcome is None else first_outcome.describe()
        raise EplError(
            f"{self._skips_in_a_row} steps in a row were skipped because a loss or gradient was NaN or Inf "
            f"(steps {first} to {self.global_step}; {self._skipped} skipped in all). It began at step {first} "
            f"with NaN or Inf in {began}. Look at the batches of those steps on those ranks, and at what makes them "
            "overflow (learning rate, loss, initialisation; under AMP float16, try bfloat16); "
            "optimizer.raise_after_skips sets how many skipped steps in a row are tolerated (None: never raise)."
        )

    @property
    def skipped_steps(self) -> int:
        """Steps whose update every rank skipped because a loss or gradient was NaN or Inf on some rank (AMP's
        overflows included), over the whole run: a checkpoint keeps the count. :attr:`global_step` counts them
        too."""
        return self._skipped

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last step's update was skipped (a loss or gradient was not finite on some rank)."""
        return self._skips_in_a_row > 0

    @property
    def lr_scheduler(self) -> LRScheduler | None:
        """The learning-rate scheduler that :meth:`step` steps and checkpoints save (None: none).

        Set it with ``epl.parallelize(..., lr_scheduler=lambda optimizer: ...)``, or assign one built over
        :attr:`optimizer`: ``engine.lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(engine.optimizer, 100)``.
        """
        return self._lr_scheduler

    @lr_scheduler.setter
    def lr_scheduler(self, scheduler: LRScheduler | None) -> None:
        from epl.errors import EplError

        if scheduler is not None and getattr(scheduler, "optimizer", None) is not self.optimizer:
            raise EplError(
                "The LR scheduler must be built over engine.optimizer (the optimizer EPL built and wrapped), not "
                "over an optimizer of the model you passed in: pass lr_scheduler=lambda optimizer: ... to "
                "epl.parallelize, or build it over engine.optimizer."
            )
        self._lr_scheduler = scheduler

    @property
    def last_step_samples(self) -> int | None:
        """Samples the last step trained on, over every replica (None before the first step, or when its
        inputs held no tensor): the replica batch's dimension 0 times :attr:`num_replicas`."""
        samples = self._last_batch[0]
        return None if samples is None else samples * self.num_replicas

    @property
    def last_step_tokens(self) -> int | None:
        """Tokens the last step trained on, over every replica: the elements of its token ids (a dict batch's
        ``input_ids``, else its first integer tensor of two or more dimensions) times :attr:`num_replicas` (and
        times ``context.degree`` under ``context.presliced``, each rank given its share); None when the batch has
        none."""
        tokens = self._last_batch[1]
        shares = self.plan.context_degree if CoreSettings.from_config(self.context.config).context.presliced else 1
        return None if tokens is None else tokens * self.num_replicas * shares

    @property
    def compile_report(self) -> CompileReport | None:
        """What ``compile.enabled`` compiled on this rank, into how many graphs, and what stayed eager (None when
        it is off)."""
        from epl.compiling import CompileState

        return self.context.state(CompileState).report

    @property
    def lr(self) -> float | None:
        """The learning rate of the optimizer's first parameter group now (None without an optimizer)."""
        optimizer = self.context.optimizer  # (the LR is the main thread's: nothing to wait for)
        return None if optimizer is None else float(optimizer.param_groups[0]["lr"])

    @torch.no_grad()
    def predict(self, inputs: Any) -> Any:
        """The model's outputs for ``inputs``, without gradients (the model's mode is unchanged).

        On a pipeline every rank takes part (a forward-only pass over the stages, by
        micro-batches); the ranks of the last stage return the outputs, the others None. Any
        batch size goes, from call to call: one that does not divide into
        ``pipeline.num_micro_batch`` micro-batches has its last one padded, and the padding
        rows are left out of the outputs.
        """
        if self.plan.num_stages > 1:
            if self.vocabulary_check is not None:
                self.vocabulary_check(inputs)
            if not isinstance(self.runner, PredictingRunner):
                raise self._lacks("predict")
            return self.runner.predict(inputs)
        return call_model(self.model, to_device(inputs, self.context.cluster.device))

    def evaluate(self, inputs: Any, targets: Any = None) -> torch.Tensor:
        """The loss of one replica batch without training on it: no gradients, no optimizer state touched.

        As ``step`` returns it (the replica's mean, the same on every rank of the replica);
        on a pipeline, a forward-only pass over the stages, for a batch of any size: one that
        does not divide into ``pipeline.num_micro_batch`` micro-batches has its last one padded,
        and the padding rows count in no loss (cut from the outputs and targets before
        ``loss_fn``; the model's own loss ignores them by their ``labels``, padded with -100).
        The model's mode is unchanged: call ``engine.eval()`` first for dropout off,
        ``engine.train()`` after.
        """
        if self.vocabulary_check is not None:
            self.vocabulary_check(inputs, targets)
        if not isinstance(self.runner, EvaluatingRunner):
            raise self._lacks("evaluate")
        return self.runner.evaluate(inputs, targets)

    def _lacks(self, name: str) -> Exception:
        from epl.errors import EplError

        return EplError(
            f"Engine.{name} needs a step runner that evaluates; {type(self.runner).__name__} (from a plugin) "
            f"has no {name}() method. Save a checkpoint (engine.save) and load it into the plain model with "
            "epl.read_model_state to evaluate it."
        )

    def train(self, mode: bool = True) -> Engine:
        """Put the model in training mode (``mode=False``: evaluation mode)."""
        self.model.train(mode)
        return self

    def eval(self) -> Engine:
        """Put the model in evaluation mode."""
        return self.train(False)

    # -- what this rank holds ----------------------------------------------------------
    @property
    def model(self) -> nn.Module:
        """This rank's model, after every transform (an optimizer step still running off the main thread,
        ``offload.overlap_step``, has finished when it is handed out)."""
        settle_pending_update(self.context.model)
        return self.context.model

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """This rank's optimizer, after every wrapper (use it for LR schedulers); its step, if still running off the
        main thread, has finished."""
        settle_pending_update(self.context.model)
        return self.context.optimizer

    @property
    def loss_scaler(self) -> LossScaler | None:
        """The AMP loss scaler (``.scale``; epl-memory's also counts ``.skipped_steps``), or None without AMP."""
        return self.context.loss_scaler

    @property
    def grad_norm(self) -> float | None:
        """The total gradient 2-norm before clipping of the last step (None without ``optimizer.max_grad_norm``).

        The norm that was clipped: the whole model's, each shard of a split tensor counted once; of
        the reduced gradient with ``communication.clip_after_allreduce``, else of this rank's rows'.
        ``optimizer.max_grad_norm: inf`` measures it without clipping (as ``clip_grad_norm_(params, inf)``).
        """
        return self.runner.grad_norm if isinstance(self.runner, ClippingRunner) else None

    @property
    def plan(self) -> Plan:
        """The Plan this engine runs."""
        return self.context.plan

    @property
    def num_replicas(self) -> int:
        """How many model replicas train in parallel (each on its own data)."""
        return self.plan.num_replicas

    @property
    def replica_index(self) -> int:
        """Which replica this rank belongs to (0 .. num_replicas - 1)."""
        return self.context.replica_index

    def parameters(self) -> Iterator[torch.Tensor]:
        """The parameters (or shards) this rank holds, as tensors it can read alone.

        A split tensor's shard is this rank's slice; under ``zero.level`` each tensor with copies is this rank's
        chunk of its rows (a plain tensor viewing the chunk, possibly with no rows), never a collective. Their
        gradients are on ``engine.model.parameters()``. :meth:`full_parameters` gathers the whole tensors.
        """
        from epl.sharding.data_shards import is_dtensor, local_tensor

        return (local_tensor(p).detach() if is_dtensor(p) else p for p in self.model.parameters())

    @contextlib.contextmanager
    def full_parameters(self) -> Iterator[None]:
        """Inside the ``with`` block, ``engine.model.parameters()`` hold the whole tensors ZeRO chunks (a collective:
        every rank calls it).

        Each block ZeRO shards gathers its parameters (one all-gather each), so the block costs, on every rank, the
        memory of every such tensor whole (of this rank's stage, and of its split shard where split cut it), as
        FSDP's ``summon_full_params`` does. Writes inside the block are lost when it ends. Without ZeRO it does
        nothing: every rank already holds its tensors.
        """
        from epl.sharding.data_shards import gathered

        with gathered(self.model):
            yield

    def memory_report(self, inputs: Any = None, targets: Any = None) -> MemoryReport:
        """Bytes this rank holds: parameters, gradients and optimizer states, counted from its tensors.

        Given a replica batch (what ``step`` takes), one forward and backward of this
        rank's part of it also measures the peak of the activations autograd saves; the
        gradients are restored afterwards and nothing is updated. That is a forward like
        ``step``'s: with split TaskGraphs every device of the replica calls it. Pipelines
        measure activations per stage in their timeline.
        """
        from epl.errors import EplError
        from epl.runtime.activations import SavedActivations
        from epl.runtime.memory import MemoryReport, optimizer_state_bytes, parameter_and_gradient_bytes

        parameters, gradients = parameter_and_gradient_bytes(self.model)
        peak = None
        if inputs is not None:
            runner = self.runner
            if self.plan.num_stages > 1 or not isinstance(runner, MeasurableRunner):
                raise EplError(
                    "Engine.memory_report(batch) measures activations of one-stage plans; for pipelines, "
                    "the runner's peak_in_flight and epl_pipeline.recording give them per stage."
                )
            if isinstance(runner, SharingRunner):  # the part of the replica batch a step gives this rank
                inputs, targets = runner.share(inputs, targets)
            kept = {p: p.grad for p in self.model.parameters()}
            for param in kept:
                param.grad = None
            batch = to_device(inputs, self.context.cluster.device), to_device(targets, self.context.cluster.device)
            meter = SavedActivations(exclude=[*kept, *tensors_in(batch)])
            with meter:
                runner.loss(*batch).backward()
            for param, grad in kept.items():
                param.grad = grad
            peak = meter.peak
        return MemoryReport(
            rank=self.context.cluster.rank,
            parameter_bytes=parameters,
            gradient_bytes=gradients,
            optimizer_state_bytes=optimizer_state_bytes(self.optimizer),
            activation_peak_bytes=peak,
        )

    # -- checkpoints -------------------------------------------------------------------
    def state_dict(self, *, full: bool = False) -> dict[str, Any]:
        """Model, optimizer, step counter and (with AMP) loss scale of this rank.

        ``full=True`` gathers every split shard and every sharded (``DTensor``) tensor into the whole tensor, one
        tensor at a time (a collective: every device holding part of a tensor must call it), so the model's entries
        have the names and shapes of the unsplit model and a local run can load them; the optimizer's state is left
        out (``None``) in that case. Otherwise a sharded tensor is this rank's ``DTensor``.
        """
        from epl.sharding.chunks import whole_of
        from epl.sharding.parameters import shard_spec

        tensors = self.model.state_dict(keep_vars=True)
        specs = {key: shard_spec(value) for key, value in tensors.items()}
        # Values from a plain state_dict: a technique that frees parameters between uses hands copies here.
        model = self.model.state_dict()
        if full:
            model = {key: whole_of(value, like=tensors[key]) for key, value in model.items()}
        shards = {key: [spec.group.index, spec.group.count] for key, spec in specs.items() if spec and not full}
        return {
            "version": STATE_VERSION,
            "model": model,
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None and not full else None,
            "global_step": self.global_step,
            "skipped_steps": self._skipped,
            #: The loss scaler's state (optional: absent or None without AMP).
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
            #: Which shard of each split tensor ``model`` holds (absent for whole tensors).
            "shards": shards,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (whole tensors are sliced to this rank's shards)."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"Engine state of version {state.get('version')!r}; this EPL reads version {STATE_VERSION}."
            )
        self.model.load_state_dict(_to_shards(self.model, state["model"], state.get("shards", {})))
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.global_step = int(state["global_step"])
        self._skipped = int(state.get("skipped_steps", 0))
        self._skips_in_a_row, self._first_skip = 0, None
        if self.loss_scaler is not None and state.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])

    def save(self, path: str | os.PathLike[str], *, asynchronous: bool = False) -> CheckpointSave:
        """Write a checkpoint directory at ``path`` that any layout can load (every rank calls it).

        Built on ``torch.distributed.checkpoint``: every rank writes its part in parallel;
        tensors are whole and named as in the model the user wrote; optimizer states,
        the loss scaler, the step counter, every rank's RNG states and where each ``epl.io`` loader
        stands in its data (:mod:`epl.io.positions`) are included. A
        crash while saving leaves the previous checkpoint at ``path`` intact. Only a previous
        checkpoint of its own is replaced: a folder holding anything else is refused on every
        rank, with nothing moved or deleted. See :mod:`epl.runtime.checkpoint`.

        ``asynchronous=True`` copies the state to CPU memory and returns while the files are written in the
        background (the steps that follow change nothing in the checkpoint); the returned
        :class:`~epl.runtime.checkpoint.CheckpointSave` has ``done()`` and ``wait(timeout)``. The next save, a
        load, ``epl.init`` and the end of the process wait for it; a failure is raised by ``wait()`` or by the
        next step, save or load.
        """
        from epl.runtime.checkpoint import save_checkpoint

        handle = save_checkpoint(self, path, asynchronous=asynchronous)
        self._pending_save = handle if asynchronous else None
        return handle

    def load(self, path: str | os.PathLike[str], *, strict: bool = True) -> None:
        """Restore a checkpoint written by :meth:`save`, under this engine's layout (every rank calls it).

        Nothing in the checkpoint is run; its files are checked against their checksums first. ``strict``
        (default): the checkpoint must hold exactly the model's tensors, shapes and dtypes, and an optimizer of
        the same kind; ``strict=False`` loads what matches (see :func:`epl.runtime.checkpoint.load_checkpoint`).
        Each ``epl.io`` loader resumes where it stood, on any number of replicas, built before or after the load
        (docs/checkpoints.md, "Resuming data").
        """
        from epl.runtime.checkpoint import load_checkpoint

        load_checkpoint(self, path, strict=strict)

    def load_pretrained(self, path: str | os.PathLike[str], *, strict: bool = True) -> int:
        """Read a transformers checkpoint folder (``model.safetensors``, or shards with
        ``model.safetensors.index.json``) into this engine's model under any layout (every rank calls it).

        Each rank reads only its stage's tensors and its shards' slices of them; names are matched to the
        model's (also under a prefix one side lacks, as transformers' ``base_model_prefix``); dtypes are converted
        to the model's. A PEFT model (``get_peft_model``, on meta or not) takes its base model's folder: each
        tensor is read under the name it has without PEFT's wrappers (``base_model.model.``, ``base_layer.``), and
        only the adapters keep their initialisation. ``strict`` (default): a name the model has and the folder
        lacks, or the reverse, is an error; ``strict=False`` loads what matches and logs a warning, on every call,
        with the count and the first names of what was not loaded. Pickle-based ``.bin`` checkpoints are
        refused. Returns the bytes this rank read. See :mod:`epl.pretrained`.
        """
        from epl.pretrained import load_pretrained

        return load_pretrained(self, path, strict=strict)

    def save_pretrained(
        self, path: str | os.PathLike[str], *, max_shard_size: int | str = "5GB", merged: bool = False
    ) -> None:
        """Write the model as a transformers checkpoint folder at ``path`` (every rank calls it): safetensors
        under the original names, several files with ``model.safetensors.index.json`` past ``max_shard_size``,
        and ``config.json`` when the model has a ``config``; ``AutoModel...from_pretrained(path)`` reads it.

        A PEFT model is written as PEFT writes its adapters (``adapter_model.safetensors`` and
        ``adapter_config.json``: ``PeftModel.from_pretrained(base, path)`` reads it); ``merged=True`` writes the
        base model with the adapters merged into its weights instead, under the base's names and config
        (``AutoModelForCausalLM.from_pretrained(path)`` reads it). A model transformers would not read back (one
        that holds a transformers config but is not a transformers model) is refused on every rank.

        Each rank writes its own pieces into the files; nothing is gathered. Written beside the files already
        in the folder (a tokenizer, a README: kept), replacing only its own. See :mod:`epl.pretrained.saving`.
        """
        from epl.pretrained import save_pretrained

        save_pretrained(self, path, max_shard_size=max_shard_size, merged=merged)

    def __repr__(self) -> str:
        return (
            f"epl.Engine(replica {self.replica_index} of {self.num_replicas}, "
            f"{self.plan.num_stages} stage(s), step {self.global_step})"
        )


def _to_shards(
    model: nn.Module, state: dict[str, torch.Tensor], shards: dict[str, list[int]]
) -> dict[str, torch.Tensor]:
    """``state`` with each whole tensor of a parameter this rank holds part of replaced by this rank's part, as
    the parameter holds it (a ``DTensor`` for a ``DTensor`` parameter; a ``DTensor`` given is taken as it is).

    A split shard saved by another device (``shards`` says which) is refused: loading it would
    silently give this device another device's part. A shard ``shards`` marks as this device's is the split
    piece: a ``DTensor`` parameter takes its chunk of it.
    """
    from epl.errors import EplError
    from epl.sharding.chunks import held, placed_like
    from epl.sharding.data_shards import is_dtensor
    from epl.sharding.parameters import shard_spec

    result = dict(state)
    for key, tensor in model.state_dict(keep_vars=True).items():
        spec = shard_spec(tensor)
        given = state.get(key)
        if given is None or is_dtensor(given):
            continue  # absent, or already this rank's part
        saved = shards.get(key)
        if spec is not None:
            mine = [spec.group.index, spec.group.count]
            if saved is not None and list(saved) != mine:
                raise EplError(
                    f"The checkpoint holds shard {saved[0]} of {saved[1]} of {key!r}, but this device holds shard "
                    f"{mine[0]} of {mine[1]}. Save split models with engine.state_dict(full=True) (every device "
                    "calls it; whole tensors load under any layout), or let every device load the file it saved."
                )
        # The logical whole (unless marked as the piece), then the split piece: each cut to what this rank holds.
        for holding in (held(tensor, split=False),) if saved is not None else (held(tensor), held(tensor, split=False)):
            if not holding.whole and tuple(given.shape) == holding.shape:
                given = holding.take(given)
                break
        result[key] = placed_like(given, tensor)
    return result


def _nonfinite_check(runner: StepRunner) -> NonFiniteCheck | None:
    """The runner's check of non-finite steps, through which every rank agrees whether an update was applied."""
    nonfinite = runner.nonfinite if isinstance(runner, ChecksNonFiniteSteps) else None
    return nonfinite if isinstance(nonfinite, NonFiniteCheck) else None


def _check_skips_are_seen(runner: StepRunner, scaler: LossScaler | None) -> None:
    """Refuse a loss scaler whose skipped updates the engine could not see: the LR scheduler would step on them."""
    if scaler is None or isinstance(scaler, CountsSkippedSteps) or _nonfinite_check(runner) is not None:
        return
    from epl.errors import PluginError

    raise PluginError(
        f"The loss scaler {type(scaler).__name__} does not count the updates it skips (skipped_steps, "
        f"epl.plugin_api.CountsSkippedSteps), and the step runner {type(runner).__name__} does not check non-finite "
        "steps itself: Engine.step could not tell a skipped update, and the LR scheduler would step on it. Give the "
        "scaler a skipped_steps count."
    )


def _needs_metric(scheduler: Any) -> bool:
    """Whether ``scheduler`` steps on a metric the script gives it (``ReduceLROnPlateau``)."""
    return isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
