"""Compile blocks' forwards with ``torch.compile``; name what a backend cannot compile, and run it eager."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from epl.errors import ConfigError, EplError

_log = logging.getLogger("epl.compile")
_COMPILED = "_epl_compiled_forward"
_NO_CACHE = "_epl_without_kv_cache"


@dataclass
class CompileReport:
    """What ``compile.enabled`` did on this rank.

    ``compiled``: the modules whose forward is compiled, by name. ``graphs``: graphs dynamo gave the backend, by
    block type (one per block type when nothing breaks the graph; more for graph breaks, recompilations for new
    shapes, and inference). ``forward_graphs`` and ``backward_graphs``: the graphs AOTAutograd split those into
    and had compiled, by block type, for ``inductor`` and ``aot_eager`` (one forward and one backward for each
    graph that needs gradients; an inference graph is a forward); empty for a backend without AOTAutograd
    (``eager``). A backward graph is compiled at the first backward, so these are complete after a step.
    ``eager``: what runs eager instead, by block type, with the backend's error.
    """

    backend: str
    compiled: list[str] = field(default_factory=list)
    graphs: dict[str, int] = field(default_factory=dict)
    forward_graphs: dict[str, int] = field(default_factory=dict)
    backward_graphs: dict[str, int] = field(default_factory=dict)
    eager: dict[str, str] = field(default_factory=dict)

    def count(self, kind: str, direction: str) -> None:
        """Count one ``direction`` ("forward" or "backward") graph AOTAutograd had compiled for block type ``kind``."""
        counts = self.forward_graphs if direction == "forward" else self.backward_graphs
        counts[kind] = counts.get(kind, 0) + 1

    def describe(self) -> str:
        """One line for logs: what is compiled, into how many graphs (and forward and backward graphs, where
        AOTAutograd made them), and what stayed eager."""
        kinds = ", ".join(self._graphs_of(kind, count) for kind, count in self.graphs.items())
        line = f"{len(self.compiled)} modules compiled by {self.backend}" + (f" ({kinds})" if kinds else "")
        if self.eager:
            line += "; eager: " + "; ".join(f"{kind} ({why})" for kind, why in self.eager.items())
        return line

    def _graphs_of(self, kind: str, count: int) -> str:
        forward, backward = self.forward_graphs.get(kind, 0), self.backward_graphs.get(kind, 0)
        split = f" = {forward} forward + {backward} backward" if forward or backward else ""
        return f"{kind}: {count} graph{'s' * (count != 1)}{split}"


class CompileState:
    """The :class:`CompileReport` of one ``epl.parallelize`` call, kept in its context (None: ``compile.enabled``
    is off)."""

    report: CompileReport | None = None


class _NamedBackend:
    """A backend that counts the graphs of one block type, and gives a graph it fails on back to run eager
    (as dynamo captured it), naming the block type and the error in the report."""

    def __init__(self, inner: Callable[..., Any], kind: str, report: CompileReport, refuse_random: bool) -> None:
        self.inner, self.kind, self.report, self.refuse_random = inner, kind, report, refuse_random

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        self.report.graphs[self.kind] = self.report.graphs.get(self.kind, 0) + 1
        drawn = draws_random(graph) if self.refuse_random else None
        if drawn is not None:
            raise EplError(
                f"compile.enabled: the compiled {self.kind} of a split model draws random numbers ({drawn}). Inside "
                "a compiled block EPL cannot switch to the split regions' own random state, so the devices' draws "
                "would not be the ones eager gives. Set the model's dropout to 0, or compile.enabled to False."
            )
        try:
            compiled: Callable[..., Any] = self.inner(graph, example_inputs)
            return compiled
        except EplError:
            raise
        except Exception as error:  # any backend failure: this graph runs eager, and the report says why
            why = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
            self.report.eager[self.kind] = why
            _log.warning("compile: %s stays eager: %s failed on it (%s)", self.kind, self.report.backend, why)
            return graph.forward

    def __getattr__(self, name: str) -> Any:  # the inner backend's own settings (e.g. inductor's config)
        return getattr(self.inner, name)


#: Torch functions and methods that draw random numbers (dropouts drawing only with ``p`` > 0 in training).
_RANDOM = frozenset(
    "rand randn randint rand_like randn_like randint_like randperm bernoulli normal multinomial poisson uniform "
    "exponential geometric cauchy log_normal random".split()
)
_DROPOUTS = frozenset("dropout dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout".split())


def draws_random(graph: torch.fx.GraphModule) -> str | None:
    """The first call of ``graph`` (a dynamo graph) that draws random numbers, by name; None when none does.
    A dropout draws unless its ``p`` is 0 or ``training`` False; attention unless its ``dropout_p`` is 0."""
    for node in graph.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
        base = name.rstrip("_")
        if base in _RANDOM:
            return name
        if base in _DROPOUTS:
            p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
            training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
            if p != 0 and training is not False:
                return name
        if base == "scaled_dot_product_attention":
            p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
            if p != 0:
                return name
    return None


def _check_backend(name: str, mode: str) -> None:
    """One clear error for a ``compile.backend`` torch does not know, or a ``compile.mode`` without inductor; an
    inductor mode is checked by inductor, which names the modes it knows."""
    from epl.torch_private import compile_backends, inductor_backend

    known = compile_backends()
    if name not in known:
        raise ConfigError(f"compile.backend {name!r} is not a torch.compile backend; use one of {', '.join(known)}.")
    if mode and name != "inductor":
        raise ConfigError(f"compile.mode {mode!r} applies to the inductor backend only, not {name!r}; remove it.")
    if mode:
        inductor_backend(mode)


def _backend(name: str, mode: str, on_graph: Callable[[str], None]) -> Callable[..., Any]:
    """The backend ``compile.backend`` names (checked), with ``compile.mode`` for inductor. ``inductor`` and
    ``aot_eager`` tell ``on_graph`` of each forward and backward graph AOTAutograd has compiled."""
    from epl.torch_private import aot_eager_backend, compile_backend, inductor_backend

    if name == "inductor":
        return inductor_backend(mode or None, on_graph)
    return aot_eager_backend(on_graph) if name == "aot_eager" else compile_backend(name)


def compile_blocks(
    modules: Sequence[tuple[str, nn.Module]], backend: str, mode: str = "", *, refuse_random: bool = False
) -> CompileReport:
    """Compile each module's ``forward`` (as it is now: a checkpointed forward is compiled with its
    recomputation) with ``torch.compile``; the module, its name, parameters and hooks stay as they are.

    Modules of one type share a backend, so dynamo compiles their code once and reuses the graph for every
    module whose attributes pass its guards (transformer blocks: one graph for all of them).
    ``refuse_random``: a graph that draws random numbers is an error (split's regions draw from their own random
    state, which a compiled block does not switch to).
    """
    report = CompileReport(backend)
    _check_backend(backend, mode)
    by_kind: dict[type[nn.Module], _NamedBackend] = {}
    for name, module in modules:
        if getattr(module, _COMPILED, False):
            continue
        kind = type(module)
        if kind not in by_kind:
            counted = functools.partial(report.count, kind.__name__)
            by_kind[kind] = _NamedBackend(_backend(backend, mode, counted), kind.__name__, report, refuse_random)
        compiled = torch.compile(module.forward, backend=by_kind[kind])
        module.forward = _with_bookkeeping(compiled) if refuse_random else compiled
        setattr(module, _COMPILED, True)
        report.compiled.append(name or "model")
    return report


def _with_bookkeeping(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled`` traced with split's bookkeeping allowed under checkpointing: the shard group's shared entry and
    sequence state, which a checkpointed block sets as it is traced. They decide what the graph computes, so the
    recomputation (the graph itself) needs none of them replayed."""
    from epl.torch_private import checkpointed_bookkeeping

    @functools.wraps(compiled)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with checkpointed_bookkeeping():
            return compiled(*args, **kwargs)

    return forward


def without_kv_cache(model: nn.Module) -> list[str]:
    """Make a transformers model's forward default to ``use_cache=False``; return the types of the modules changed.

    EPL trains and predicts whole sequences, so nothing reads a KV cache. Built on every call, it is an input each
    block guards on by its layer's index, so every block would compile again (and dynamo gives up after 8). A
    call that passes ``use_cache`` gets what it asks for.
    """
    changed = []
    for module in model.modules():
        config = getattr(module, "config", None)
        if not getattr(config, "use_cache", False) or getattr(module, _NO_CACHE, False):
            continue
        try:
            takes = "use_cache" in inspect.signature(module.forward).parameters
        except (TypeError, ValueError):
            takes = False
        if not takes:
            continue
        original = module.forward

        @functools.wraps(original)
        def forward(*args: Any, __original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            kwargs.setdefault("use_cache", False)
            return __original(*args, **kwargs)

        module.forward = forward
        setattr(module, _NO_CACHE, True)
        changed.append(type(module).__name__)
    return changed
