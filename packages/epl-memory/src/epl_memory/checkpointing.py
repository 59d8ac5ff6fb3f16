"""Gradient checkpointing: recompute chosen modules' activations in backward instead of keeping them.

A checkpointed module keeps its name, parameters and hooks: only its ``forward``
is replaced (an instance attribute) by one that runs the original under
``torch.utils.checkpoint`` (non-reentrant, random state preserved, so dropout draws
the same mask when it is recomputed). ``nn.Sequential`` segments are checkpointed
the same way, through the container's ``forward``. Selectively (``gradient_checkpoint.type = "selective"``),
the matrix products' outputs are kept and only the cheap operations between them recomputed
(:mod:`epl_memory.selective`).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from epl_memory.selective import checkpointed

_log = logging.getLogger("epl.memory")
_MARK = "_epl_checkpoint"
_WRAPPED = "_epl_checkpointed_forward"


def checkpoint(module: nn.Module) -> nn.Module:
    """Mark ``module`` for recomputation under ``gradient_checkpoint.type = "collection"``; return it.

    The PyTorch counterpart of adding tensors to the manual's checkpoint collection:
    the activations inside ``module`` are not kept for backward but recomputed.
    """
    setattr(module, _MARK, True)
    return module


def is_marked(module: nn.Module) -> bool:
    """Whether :func:`checkpoint` marked ``module``."""
    return bool(getattr(module, _MARK, False))


def recompute_forward(
    module: nn.Module,
    check: GradientCheck | None = None,
    name: str = "",
    selective: bool = False,
    warned: set[str] | None = None,
) -> None:
    """Replace ``module.forward`` by a checkpointed call of it (idempotent); ``selective``: keep the matrix
    products' outputs (:mod:`epl_memory.selective`); ``warned``: shared by the modules of one plan, which say
    once that they run without their key/value cache (:func:`without_cache`)."""
    if getattr(module, _WRAPPED, False):
        return
    original = module.forward
    warned = set() if warned is None else warned

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        kwargs = without_cache(kwargs, name, warned)
        if check is not None and check.pending(name):
            return check.run(name, original, list(module.parameters()), args, kwargs, selective)
        return checkpointed(original, selective)(*args, **kwargs)

    module.forward = forward
    setattr(module, _WRAPPED, True)


#: The keyword arguments by which transformers' layers receive their key/value cache (as its own checkpointing
#: drops them: ``transformers.modeling_layers.GradientCheckpointingLayer``).
CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "layer_past")


def without_cache(kwargs: dict[str, Any], name: str, warned: set[str]) -> dict[str, Any]:
    """``kwargs`` without a key/value cache (None) and with ``use_cache=False``; the warning once for the modules
    sharing ``warned`` (those of one plan).

    A layer that writes its cache would write it again when its forward is recomputed: the recomputation would
    attend over the keys twice (and selective checkpointing finds operations the forward did not run). The cache
    serves generation, not training; transformers' own checkpointing drops it the same way."""
    dropped = [key for key in CACHE_ARGUMENTS if kwargs.get(key) is not None]
    if not dropped and not kwargs.get("use_cache"):
        return kwargs
    kwargs = {**kwargs, **dict.fromkeys(dropped), **({"use_cache": False} if "use_cache" in kwargs else {})}
    if not warned:  # once: every layer of a model gets the same cache
        warned.add(name)
        _log.warning(
            "Gradient checkpointing of %s runs it without its key/value cache (%s): recomputation would write the "
            "cache twice. Build the model with use_cache=False to silence this.",
            name or "the model",
            ", ".join([*dropped, "use_cache"] if "use_cache" in kwargs else dropped),
        )
    return kwargs


@dataclass
class GradientCheck:
    """``gradient_checkpoint.check_gradients``: on its first call, each checkpointed unit runs plainly too,
    and the gradients of a fixed projection of its output (to its inputs and parameters) are compared.

    ``results`` maps each unit to the largest absolute difference (None: its output is not one tensor).
    """

    results: dict[str, float | None] = field(default_factory=dict)

    def pending(self, name: str) -> bool:
        """Whether ``name`` has not been checked yet."""
        return name not in self.results

    def run(
        self,
        name: str,
        fn: Callable[..., Any],
        params: list[nn.Parameter],
        args: Any,
        kwargs: Any,
        selective: bool = False,
    ) -> Any:
        """Run ``fn`` plainly and checkpointed from the same random state; compare; return the checkpointed output.

        Selectively checkpointed regions allow one backward each (torch's rule): the comparison runs on a checkpointed
        call of its own, and the output returned is a third call's, from the same random state again."""
        state = torch.random.get_rng_state()
        plain = fn(*args, **kwargs)
        torch.random.set_rng_state(state)
        out = checkpointed(fn, selective)(*args, **kwargs)
        if not isinstance(out, torch.Tensor) or not out.requires_grad:
            self.results[name] = None
            return out
        probe = out
        if selective:
            torch.random.set_rng_state(state)
            out = checkpointed(fn, selective)(*args, **kwargs)
        targets = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad] + [
            p for p in params if p.requires_grad
        ]
        projection = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(out)
        expected = torch.autograd.grad(plain, targets, projection, allow_unused=True)
        got = torch.autograd.grad(probe, targets, projection, retain_graph=not selective, allow_unused=True)
        differences = [
            float((a - b).abs().max()) for a, b in zip(expected, got, strict=True) if a is not None and b is not None
        ]
        self.results[name] = max(differences, default=0.0)
        _log.info("gradient check of %s: largest difference %.3g", name or "model", self.results[name])
        return out


def recompute_segments(sequential: nn.Sequential, segments: Sequence[range], selective: bool = False) -> None:
    """Make ``sequential`` run each of ``segments`` (ranges of its items) as one checkpointed call."""
    items = list(sequential)

    def run(part: range, x: Any) -> Any:
        for index in part:
            x = items[index](x)
        return x

    def forward(x: Any) -> Any:
        for part in segments:
            step: Callable[[Any], Any] = functools.partial(run, part)
            if torch.is_grad_enabled() and len(part) > 0:
                x = checkpointed(step, selective)(x)
            else:
                x = step(x)
        return x

    sequential.forward = forward  # type: ignore[method-assign]  # this instance's, over the class's method
    setattr(sequential, _WRAPPED, True)


@dataclass(frozen=True)
class CheckpointPlan:
    """What ``auto`` or ``collection`` chose: whole modules by name, and Sequential segments."""

    modules: tuple[str, ...] = ()
    #: Name of an nn.Sequential and the ranges of its items run as one checkpointed segment each.
    segments: tuple[tuple[str, tuple[range, ...]], ...] = ()

    def describe(self) -> str:
        """One line for logs and errors."""
        parts = [f"{len(self.modules)} modules"] if self.modules else []
        parts += [f"{name or 'model'}: {len(ranges)} segments" for name, ranges in self.segments]
        return ", ".join(parts) or "nothing"


def plan_collection(model: nn.Module, allowed: Callable[[nn.Module], bool]) -> CheckpointPlan:
    """The modules the user marked with :func:`checkpoint` (outermost ones only)."""
    chosen: list[str] = []
    for name, module in model.named_modules():
        if is_marked(module) and allowed(module) and not any(name.startswith(f"{c}.") for c in chosen):
            chosen.append(name)
    return CheckpointPlan(modules=tuple(chosen))


def plan_auto(model: nn.Module, allowed: Callable[[nn.Module], bool], within: Collection[str] = ()) -> CheckpointPlan:
    """Repeated blocks (the items of the largest list of same-type modules, e.g. transformer layers),
    else about sqrt(N) segments of the largest ``nn.Sequential``, balanced by parameter count.

    ``within``: the modules that run whole (a pipeline stage's roots; empty: the whole model):
    only blocks inside them count (a list of layers whose other items are other stages' gives
    this stage's items), and only Sequentials inside them are segmented.
    """

    from epl.plugin_api import repeated_blocks

    def runs(name: str) -> bool:
        return not within or any(name == root or name.startswith(f"{root}.") for root in within)

    blocks = [name for name, block in repeated_blocks(model, within) if allowed(block)]
    if blocks:
        return CheckpointPlan(modules=tuple(blocks))
    sequentials = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Sequential) and len(m) >= 2]
    sequentials = [(n, m) for n, m in sequentials if allowed(m) and runs(n)]
    if not sequentials:
        return CheckpointPlan()
    name, sequential = max(sequentials, key=lambda item: len(item[1]))
    return CheckpointPlan(segments=((name, balanced_segments(sequential)),))


def balanced_segments(sequential: nn.Sequential) -> tuple[range, ...]:
    """About sqrt(N) consecutive segments of the N items, each holding about the same parameter count."""
    sizes = [sum(p.numel() for p in item.parameters()) + 1 for item in sequential]
    count = max(1, round(math.sqrt(len(sizes))))
    target = sum(sizes) / count
    segments: list[range] = []
    start, running = 0, 0.0
    for index, size in enumerate(sizes):
        running += size
        remaining_items = len(sizes) - index - 1
        remaining_segments = count - len(segments) - 1
        if (running >= target and remaining_segments > 0) or remaining_items < remaining_segments:
            segments.append(range(start, index + 1))
            start, running = index + 1, 0.0
    if start < len(sizes):
        segments.append(range(start, len(sizes)))
    return tuple(segments)


def apply_plan(
    model: nn.Module, plan: CheckpointPlan, check: GradientCheck | None = None, selective: bool = False
) -> None:
    """Checkpoint what ``plan`` names in ``model`` (``check``: compare gradients once per module; ``selective``:
    keep the matrix products' outputs)."""
    warned: set[str] = set()
    for name in plan.modules:
        recompute_forward(model.get_submodule(name) if name else model, check, name, selective, warned)
    for name, ranges in plan.segments:
        sequential = model.get_submodule(name) if name else model
        assert isinstance(sequential, nn.Sequential)
        recompute_segments(sequential, ranges, selective)


@dataclass
class CheckpointingState:
    """Gradient checkpointing's state in a ParallelContext (``context.state(CheckpointingState)``)."""

    #: The modules it recomputes.
    plan: CheckpointPlan | None = None
    #: The recomputation check (``gradient_checkpoint.check_gradients``), if on.
    check: GradientCheck | None = None
