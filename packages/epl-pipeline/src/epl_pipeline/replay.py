"""Pipelines of models ``torch.fx`` cannot trace: every stage runs the model's own ``forward``.

transformers' models (and many others) build caches and masks in ``forward`` with code
fx cannot follow. Their stages are run *eagerly* instead: each stage calls the model's
``forward`` as it is, with the other stages' root modules replaced by placeholders.

- A root module of an earlier stage returns, instead of computing, what that stage
  sent for this call (its output, received along the pipeline).
- A root module of a later stage ends this stage's forward: what the later stages need is
  then sent on.
- A rank that runs several stages (interleaved pipelines) keeps their modules; while one of
  its stages runs, the others' root modules act as the placeholders above.
- The code between root modules (masks, position ids, reshapes) runs on every stage that
  reaches it; it holds no parameters and is cheap beside the blocks.

Which outputs a later stage needs is recorded once, from one example forward of the whole
model: every torch call outside the root modules is followed (a ``TorchFunctionMode``),
so each tensor knows which root calls' outputs it was computed from. A call's output is
sent on while a later stage's root module, or the model's output, reads it. An output no
later stage reads travels as its shape only; the stages that only pass it from one
placeholder to the next get zeros of that shape (their values are never used), so the
code between the blocks runs on tensors of the right shape, dtype and device.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from epl.plugin_api import PlacementError, call_model, forked_rng, tensors_in
from epl_pipeline.channel import ShapeOnly
from epl_pipeline.stages import ACTIVE_REPLAY, RemoteStage


@dataclass(frozen=True)
class RootCall:
    """One call of a stage's root module in the example forward."""

    module: str
    stage: int
    #: The latest stage that reads this call's output (-1: none); the output is sent on until it.
    last_reader: int
    #: The call's arguments other than tensors (Gemma 3's rotary embedding is called once per layer type): what
    #: tells two calls of one module apart when the ranks compare their call orders.
    key: str = ""


class _StageEnd(BaseException):
    """Raised by a later stage's placeholder: this stage's part of ``forward`` is done.

    A ``BaseException``, so that no ``except Exception`` in a model's ``forward`` swallows it.
    """


@dataclass
class ReplayedStages:
    """Stage programs that run the model's own ``forward`` (a :class:`~epl_pipeline.program.StageProgram`)."""

    calls: list[RootCall]
    num_stages: int
    _hooked: set[int] = field(default_factory=set, repr=False)
    _zeros: dict[tuple[ShapeOnly, torch.device], torch.Tensor] = field(default_factory=dict, repr=False)

    def call_order(self) -> list[str]:
        """The stage modules' calls in the example run, each as its module and arguments: the same on every rank,
        or the ranks would pair one's outputs with another's calls."""
        return [f"{call.module}{call.key}" for call in self.calls]

    def run(self, model: nn.Module, stage: int, inputs: Any, received: list[Any] | None) -> Any:
        """Run ``forward`` as far as ``stage`` goes; the values to send on, or (last stage) the output."""
        self._hook_local_roots(model, stage)
        replay = _Replay(self, stage, received or [])
        token = ACTIVE_REPLAY.set(replay)
        try:
            with self._other_stages_stand_in(model, stage):
                output = call_model(model, inputs)
        except _StageEnd:
            return replay.to_send()
        finally:
            ACTIVE_REPLAY.reset(token)
        if stage < self.num_stages - 1:
            raise PlacementError(
                f"The model's forward returned before calling stage {stage + 1}'s modules, which it called in the "
                "example run. Pipelines need forward to call the same modules in the same order every time."
            )
        replay.check_complete()
        return output

    def stand_in(self, value: Any, device: torch.device) -> Any:
        """``value`` with each :class:`ShapeOnly` leaf as zeros of its shape (one shared tensor per shape)."""

        def zeros(leaf: Any) -> Any:
            if not isinstance(leaf, ShapeOnly):
                return leaf
            key = (leaf, device)
            if key not in self._zeros:
                self._zeros[key] = torch.zeros(leaf.shape, dtype=leaf.torch_dtype, device=device)
            return self._zeros[key]

        return pytree.tree_map(zeros, value)

    def _hook_local_roots(self, model: nn.Module, stage: int) -> None:
        """Hook this stage's root modules once, as they are after every transform (sharded, wrapped)."""
        if stage in self._hooked:
            return
        for name in self._roots_of(stage):
            module = model.get_submodule(name)
            module.register_forward_pre_hook(_local_call_starts(name, stage))
            module.register_forward_hook(_local_call_ends(stage), always_call=True)
        self._hooked.add(stage)

    @contextlib.contextmanager
    def _other_stages_stand_in(self, model: nn.Module, stage: int) -> Iterator[None]:
        """While ``stage`` runs, the roots of the other stages this rank also runs (interleaved pipelines) act
        as placeholders, as other ranks' stages do; their own ``forward`` (perhaps a wrapper's) comes back after."""
        replaced: list[tuple[nn.Module, Any]] = []
        try:
            for other in {call.stage for call in self.calls} - {stage}:
                for name in self._roots_of(other):
                    module = model.get_submodule(name)
                    if not isinstance(module, RemoteStage):
                        replaced.append((module, module.__dict__.get("forward")))
                        module.forward = functools.partial(_stand_in, name, _device_of(module, model))
            yield
        finally:
            for module, own in replaced:
                if own is None:
                    del module.forward
                else:
                    module.forward = own

    def _roots_of(self, stage: int) -> list[str]:
        return list(dict.fromkeys(call.module for call in self.calls if call.stage == stage))


class _Replay:
    """One stage's run of ``forward`` on one micro-batch: which root call comes next, and the outputs so far."""

    def __init__(self, program: ReplayedStages, stage: int, received: list[Any]) -> None:
        self.program, self.stage = program, stage
        self.outputs: list[Any] = list(received)  # the received outputs of earlier stages' calls come first
        self.next = 0

    def expect(self, module: str) -> RootCall:
        """The record of the root call ``module`` makes now (checked against the example run)."""
        calls = self.program.calls
        if self.next >= len(calls) or calls[self.next].module != module:
            expected = calls[self.next].module if self.next < len(calls) else "no more stage modules"
            raise PlacementError(
                f"The model's forward called {module!r} where the example run called {expected!r} (stage module "
                f"call {self.next}). Pipelines need forward to call the same modules in the same order every time: "
                "keep data-dependent branches inside one stage's module."
            )
        return calls[self.next]

    def remote_call(self, module: str, device: torch.device) -> Any:
        """What another stage's root module returns here: the earlier stage's output, or the end of this stage."""
        call = self.expect(module)
        if call.stage > self.stage:
            raise _StageEnd
        value = self.program.stand_in(self.outputs[self.next], device)
        self.next += 1
        return value

    def local_call_ends(self, output: Any) -> None:
        """Keep the output of this stage's root call."""
        self.outputs.append(output)
        self.next += 1

    def to_send(self) -> list[Any]:
        """Every root call's output so far: whole while a later stage reads it, else its shape only."""
        return [
            value if call.last_reader > self.stage else pytree.tree_map(ShapeOnly.of, value)
            for call, value in zip(self.program.calls, self.outputs, strict=False)
        ]

    def check_complete(self) -> None:
        """On the last stage: every recorded root call was made."""
        if self.next != len(self.program.calls):
            raise PlacementError(
                f"The model's forward made {self.next} stage module calls where the example run made "
                f"{len(self.program.calls)}. Pipelines need forward to call the same modules every time."
            )


def _local_call_starts(name: str, stage: int) -> Any:
    def hook(module: nn.Module, args: Any) -> None:
        replay = ACTIVE_REPLAY.get()
        if replay is not None and replay.stage == stage:
            replay.expect(name)

    return hook


def _local_call_ends(stage: int) -> Any:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        replay = ACTIVE_REPLAY.get()
        if replay is not None and replay.stage == stage:
            replay.local_call_ends(output)

    return hook


def _stand_in(name: str, device: torch.device, *args: Any, **kwargs: Any) -> Any:
    """The ``forward`` of a root of another stage on this rank: what a :class:`RemoteStage` returns."""
    replay = ACTIVE_REPLAY.get()
    assert replay is not None, "stand-ins are in place only while a stage runs"
    return replay.remote_call(name, device)


def _device_of(module: nn.Module, model: nn.Module) -> torch.device:
    """Where ``module`` computes; for a module without tensors (it takes its inputs' device), the rest of ``model``'s:
    the stage's device, not the CPU, or its stand-in zeros would meet the stage's tensors on another device."""
    tensors = itertools.chain(module.parameters(), module.buffers(), model.parameters(), model.buffers())
    tensor = next(tensors, None)
    return tensor.device if tensor is not None else torch.device("cpu")


# -- the example run ---------------------------------------------------------------------


def record_calls(model: nn.Module, roots: Mapping[str, int], num_stages: int, example: Any) -> ReplayedStages:
    """Run the whole ``model`` once on ``example`` and record its root calls and who reads their outputs.

    ``roots`` maps each stage root's qualified name to its stage. Nothing is learned and
    the random state is left as it was. Raises when the stages are not called in order.
    """
    tracker = _Readers(roots)
    handles: list[RemovableHandle] = []
    for name in roots:
        module = model.get_submodule(name)
        handles.append(module.register_forward_pre_hook(tracker.before(name), with_kwargs=True))
        handles.append(module.register_forward_hook(tracker.after, always_call=True))
    try:
        with torch.no_grad(), forked_rng(model), tracker:
            output = call_model(model, example)
        tracker.read_by(output, num_stages - 1)
    finally:
        for handle in handles:
            handle.remove()
    calls = [
        RootCall(name, stage, reader, key)
        for (name, stage, key), reader in zip(tracker.calls, tracker.last_reader, strict=True)
    ]
    _check_order(model, calls, num_stages)
    return ReplayedStages(calls, num_stages)


def call_order(model: nn.Module, names: set[str], example: Any) -> list[str]:
    """The modules of ``names`` in the order ``model``'s forward first calls them on ``example``."""
    order: list[str] = []
    handles = [
        model.get_submodule(name).register_forward_pre_hook(lambda *_, name=name: order.append(name)) for name in names
    ]
    try:
        with torch.no_grad(), forked_rng(model):
            call_model(model, example)
    finally:
        for handle in handles:
            handle.remove()
    return list(dict.fromkeys(order))


class _Readers(TorchFunctionMode):
    """Follows which root calls' outputs each tensor is computed from, outside the root modules."""

    def __init__(self, roots: Mapping[str, int]) -> None:
        super().__init__()
        self.roots = roots
        self.calls: list[tuple[str, int, str]] = []
        self.last_reader: list[int] = []
        self.sources: dict[int, frozenset[int]] = {}
        self._alive: list[torch.Tensor] = []  # tensors keep their ids while they are followed
        self._inside = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        if not self._inside:
            found = self._sources_of((args, kwargs))
            if found:
                for tensor in tensors_in(result):
                    self.sources[id(tensor)] = self.sources.get(id(tensor), frozenset()) | found
                    self._alive.append(tensor)
        return result

    def before(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if not self._inside:
                self.read_by((args, kwargs), self.roots[name])
                self.calls.append((name, self.roots[name], _key((args, kwargs))))
                self.last_reader.append(-1)
            self._inside += 1

        return hook

    def after(self, module: nn.Module, args: Any, output: Any) -> None:
        self._inside -= 1
        if not self._inside:
            for tensor in tensors_in(output):
                self.sources[id(tensor)] = frozenset({len(self.calls) - 1})
                self._alive.append(tensor)

    def read_by(self, value: Any, stage: int) -> None:
        """``value`` is read by ``stage``: the calls it was computed from are sent on until there."""
        for index in self._sources_of(value):
            self.last_reader[index] = max(self.last_reader[index], stage)

    def _sources_of(self, value: Any) -> frozenset[int]:
        return frozenset().union(*(self.sources.get(id(t), frozenset()) for t in tensors_in(value)))


def _key(value: Any) -> str:
    """The arguments of a call, numbers and strings as they are, anything else by its type (a tensor as ``T``):
    what tells calls of one module apart, the same in every process."""

    def plain(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return "T"
        return leaf if leaf is None or isinstance(leaf, (str, int, float, bool)) else type(leaf).__name__

    return repr(pytree.tree_map(plain, value))[:200]


def _check_order(model: nn.Module, calls: list[RootCall], num_stages: int) -> None:
    """Stages must be called in order, each at least once."""
    for before, after in zip(calls, calls[1:], strict=False):
        if after.stage < before.stage:
            raise PlacementError(
                f"Cannot pipeline {type(model).__name__}: its forward calls {after.module!r} (stage {after.stage}) "
                f"after {before.module!r} (stage {before.stage}). Stages must follow the order forward calls their "
                "modules; annotate (or cut) the modules in that order."
            )
    called = {call.stage for call in calls}
    missing = [stage for stage in range(num_stages) if stage not in called]
    if missing:
        raise PlacementError(
            f"Cannot pipeline {type(model).__name__}: forward never calls the modules of stage {missing[0]} in the "
            "example run. Every stage must hold modules that forward calls."
        )
