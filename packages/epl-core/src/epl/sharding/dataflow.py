"""A record of what feeds what in one forward pass: the evidence the split layout is decided from.

The model runs once on a small example input (no gradients, evaluation mode, the
random state left as it was) under a ``TorchFunctionMode`` that logs every torch
call with the tensors it took and made. The *candidate* modules (those that may be
sharded as linear layers) are logged as one call each, with how their forward
used the weight (``x @ W.T`` as ``nn.Linear``, or ``x @ W`` as GPT-2's ``Conv1D``);
every other module is looked through, so a model no rule has seen is analysed by
its computation, not by its class names.
"""

from __future__ import annotations

import contextlib
import inspect
import linecache
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

#: How a linear-like module holds its weight: ``out_in`` as nn.Linear ([out, in]), ``in_out`` as Conv1D.
WeightLayout = Literal["out_in", "in_out"]

_MATMULS: set[Callable[..., Any]] = {torch.addmm, torch.matmul, torch.mm, torch.Tensor.__matmul__, torch.Tensor.matmul}
_TRANSPOSES: set[Callable[..., Any]] = {
    torch.Tensor.T.__get__,  # type: ignore[attr-defined]  # the property's getter (typed as what it returns)
    torch.Tensor.t,
    torch.t,
}


@dataclass
class Op:
    """One torch call made outside the candidate modules."""

    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    result: Any
    #: The innermost module whose forward made the call ('' for the model itself).
    module: str
    #: For views and reshapes: the source line that made the call, and the integer attributes of the object whose
    #: method made it (``self``): whether the sizes it names are counts the module keeps (``self.num_heads``) or
    #: come from tensors' shapes. Empty otherwise.
    line: str = ""
    counts: frozenset[int] = frozenset()


@dataclass
class ModuleCall:
    """One call of a candidate module: its tensor inputs and outputs, and how it used its weight."""

    name: str
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    weight_layout: WeightLayout | None = None
    #: The torch calls its forward made (by name), to tell a plain product from a subclass's extra work.
    inner: list[str] = field(default_factory=list)


@dataclass
class Span:
    """One call of a module that is not a candidate: which events it made (``events[start:end]``), the tensors
    it took (its first positional argument, or else its ``hidden_states``, first) and the tensors it returned."""

    name: str
    start: int
    inputs: list[torch.Tensor]
    end: int = -1
    outputs: list[torch.Tensor] = field(default_factory=list)


@dataclass
class Dataflow:
    """The events of one forward pass, in order, with the model's inputs and outputs."""

    events: list[Op | ModuleCall] = field(default_factory=list)
    #: The calls of the modules that are not candidates (outside any candidate's call), in the order they began.
    spans: list[Span] = field(default_factory=list)
    inputs: list[torch.Tensor] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)
    #: ``id(parameter)`` -> its name, for the model's parameters that learn (the events hold the same objects).
    parameters: dict[int, str] = field(default_factory=dict)

    def calls_of(self, name: str) -> list[ModuleCall]:
        """Every call of the candidate module ``name``."""
        return [e for e in self.events if isinstance(e, ModuleCall) and e.name == name]


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside ``value`` (nested tuples, lists, dicts, dataclass-like model outputs)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)


class _Recorder(TorchFunctionMode):
    def __init__(self, flow: Dataflow, candidates: dict[nn.Module, str], names: dict[nn.Module, str]) -> None:
        super().__init__()
        self.flow = flow
        self.candidates = candidates
        self.names = names
        self.stack: list[nn.Module] = []
        self.open: list[tuple[ModuleCall, nn.Module]] = []
        #: The transpose of the open candidate's weight, when its forward made one.
        self.transposed: torch.Tensor | None = None
        self.open_spans: list[Span | None] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if self.open:
            self._note_weight_use(func, args, kwargs, result)
        elif any(True for _ in tensors_in((args, kwargs))):
            inner = self.names.get(self.stack[-1], "") if self.stack else ""
            line, counts = _caller() if getattr(func, "__name__", "") in ("view", "reshape") else ("", frozenset())
            self.flow.events.append(Op(func, args, dict(kwargs), result, inner, line, counts))
        return result

    def _note_weight_use(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> None:
        call, module = self.open[0]
        call.inner.append(getattr(func, "__name__", str(func)))
        # A wrapped linear (PEFT's LoRA layer) computes with its base layer's weight.
        base = getattr(module, "base_layer", None)
        weight = getattr(base if isinstance(base, nn.Module) else module, "weight", None)
        if weight is None or call.weight_layout is not None:
            return
        if func in _TRANSPOSES and args and args[0] is weight:  # ``x @ self.weight.T`` (Falcon's FalconLinear)
            self.transposed = result
        elif func is F.linear and len(args) > 1 and args[1] is weight:
            call.weight_layout = "out_in"
        elif func in _MATMULS and args and args[-1] is weight:
            call.weight_layout = "in_out"
        elif func in _MATMULS and args and self.transposed is not None and args[-1] is self.transposed:
            call.weight_layout = "out_in"

    def before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.stack.append(module)
        if module not in self.candidates:
            span = None
            if not self.open:
                first = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
                inputs = list(tensors_in((args, kwargs)))
                if isinstance(first, torch.Tensor):  # the stream a block or a region takes comes first
                    inputs = [first, *(t for t in inputs if t is not first)]
                span = Span(self.names.get(module, ""), len(self.flow.events), inputs)
                self.flow.spans.append(span)
            self.open_spans.append(span)
        if module in self.candidates:
            # A candidate inside another is part of the outer one's call.
            name = "" if self.open else self.candidates[module]
            if not self.open:
                self.transposed = None
            self.open.append((ModuleCall(name, list(tensors_in((args, kwargs))), []), module))

    def after(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        self.stack.pop()
        if module not in self.candidates:
            span = self.open_spans.pop()
            if span is not None:
                span.end, span.outputs = len(self.flow.events), list(tensors_in(_as_plain(output)))
        if module in self.candidates:
            call, _ = self.open.pop()
            if not self.open:
                call.outputs = list(tensors_in(output))
                self.flow.events.append(call)


def _caller() -> tuple[str, frozenset[int]]:
    """The source line of the model's code that made the torch call being recorded, and the integer attributes
    of its ``self`` (none outside a method)."""
    frame = inspect.currentframe()
    while frame is not None and (frame.f_code.co_filename == __file__ or "/torch/" in frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return "", frozenset()
    owner = frame.f_locals.get("self")
    fields = vars(owner) if hasattr(owner, "__dict__") else {}
    counts = frozenset(v for v in fields.values() if type(v) is int)
    return linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip(), counts


def record_dataflow(model: nn.Module, candidates: set[str], example: Any) -> Dataflow:
    """Run ``model`` once on ``example`` (a tensor, a tuple of positional inputs, or a dict of keyword inputs).

    Nothing is learned and nothing changes: no gradients, evaluation mode (restored
    after), the random state forked.
    """
    names = {module: name for name, module in model.named_modules()}
    chosen = {module: name for module, name in names.items() if name in candidates}
    flow = Dataflow(parameters={id(p): name for name, p in model.named_parameters() if p.requires_grad})
    recorder = _Recorder(flow, chosen, names)
    handles = []
    for module in names:
        handles.append(module.register_forward_pre_hook(recorder.before, with_kwargs=True))
        handles.append(module.register_forward_hook(recorder.after, with_kwargs=True, always_call=True))
    training = {module: module.training for module in names}
    try:
        model.eval()
        with torch.no_grad(), forked_rng(model), recorder:
            if isinstance(example, dict):
                flow.inputs = list(tensors_in(example))
                output = model(**example)
            else:
                positional = example if isinstance(example, tuple) else (example,)
                flow.inputs = list(tensors_in(positional))
                output = model(*positional)
        flow.outputs = list(tensors_in(_as_plain(output)))
    finally:
        for handle in handles:
            handle.remove()
        for module, mode in training.items():
            module.training = mode
    return flow


def _as_plain(output: Any) -> Any:
    """Model outputs that are dataclass-like mappings (transformers' ``ModelOutput``) as dicts."""
    if hasattr(output, "to_tuple") and callable(output.to_tuple):
        return output.to_tuple()
    return output


@contextlib.contextmanager
def forked_rng(model: nn.Module) -> Iterator[None]:
    """Leaves the random state as it was on exit (CPU, and the CUDA devices ``model`` is on): example runs
    draw no numbers the training would have drawn. Every example run of the whole model enters it: for a
    model built on ``meta`` in a run, it also gives each layer its values while it runs
    (:mod:`epl.materialize.streaming`); in ``epl plan`` such a model runs on ``meta``, computing shapes only."""
    from epl.materialize.streaming import active_stream

    stream = active_stream(model)
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    if stream is not None and stream.device.type == "cuda":
        devices = sorted({*devices, stream.device.index or 0})
    with torch.random.fork_rng(devices=devices), stream.on_use() if stream is not None else contextlib.nullcontext():
        yield


def example_input(model: nn.Module) -> Any | None:
    """A small input ``model`` can run on, or None when none can be guessed.

    transformers models offer ``dummy_inputs``; otherwise the first module holding
    parameters decides: token ids for an ``nn.Embedding``, a float batch for an
    ``nn.Linear``.
    """
    from epl.materialize.streaming import shapes_only

    device = _example_device(model)
    dummy = getattr(model, "dummy_inputs", None)
    if isinstance(dummy, dict) and dummy:
        example = {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in dummy.items()}
        accepted = inspect.signature(model.forward).parameters
        # A wrapper passing its keywords on (PEFT's PeftModel) takes the wrapped model's, whose config says so.
        passes_on = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
        if "use_cache" in accepted or (passes_on and hasattr(getattr(model, "config", None), "use_cache")):
            example["use_cache"] = False  # training runs keep no key/value cache
        if shapes_only(model) and "attention_mask" in accepted and "input_ids" in example:
            # epl plan: the layers compute shapes on meta; a mask of real values (no padding) spares transformers'
            # mask code a test of values computed on meta (packed sequences), which a shapes-only run cannot do.
            example.setdefault("attention_mask", torch.ones_like(example["input_ids"]))
        return example
    first = next((m for m in model.modules() if any(True for _ in m.parameters(recurse=False))), None)
    if isinstance(first, nn.Embedding):
        return torch.arange(16, device=device).remainder(first.num_embeddings).reshape(2, 8)
    if isinstance(first, nn.Linear):
        values = torch.zeros(2, first.in_features, dtype=first.weight.dtype)
        return values.normal_(generator=torch.Generator().manual_seed(0)).to(device)
    return None


def _example_device(model: nn.Module) -> torch.device:
    """Where an example run's inputs go: the model's device. For a model built on ``meta``: the device its layers
    get their values on while it runs, or in ``epl plan`` the CPU: the code on the inputs alone (masks from token
    ids) computes real values there, the layers compute shapes on ``meta``."""
    from epl.materialize.streaming import active_stream

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type != "meta":
        return device
    stream = active_stream(model)
    return stream.device if stream is not None else torch.device("cpu")
