"""The values of one init unit, from the model's own initialisation, with a random stream of the unit's own.

:func:`initialize_unit` puts fresh tensors in the unit's slots, runs what initialises them, reads the
values and puts the original tensors back: nothing of the model changes. What runs, in the order
eager construction runs it:

1. ``reset_parameters()`` of each module of the unit that has one (``nn.Linear``, ``nn.Embedding``,
   norms, and any module written the torch way), in pre-order;
2. transformers' ``_init_weights(module)`` of the nearest ``PreTrainedModel`` holding it, in post-order
   (children first, as ``PreTrainedModel.initialize_weights`` does).

A unit of a transformers model is first initialised by ``_init_weights`` alone (step 2 without step 1 for the
modules it owns), as transformers initialises the weights a checkpoint lacks on a model built on meta: step 1's
values would be overwritten, and drawing them cost 40% of a Llama's initialisation. When that leaves a tensor
unset, the unit is initialised again with both steps.

The random stream is seeded from the job's seed and the unit's name (:func:`unit_seed`), so a unit gets the
same values on every rank, whatever else a rank builds, and in a one-process run. A tensor that nothing
initialised is an error, never garbage: floating tensors start as NaN and must not stay so; other tensors
(integer and boolean buffers) are initialised twice from two different fills, which must agree.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from epl.errors import UninitializedError
from epl.materialize.adapters import AdapterInitError
from epl.materialize.units import InitUnit

#: A slot a transform has since emptied (restored as absent).
_ABSENT: Any = object()


def unit_seed(base_seed: int, unit: str) -> int:
    """The seed of the unit named ``unit`` in a job whose seed is ``base_seed`` (the same on every rank)."""
    digest = hashlib.sha256(f"{base_seed}/{unit}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def initialize_unit(
    unit: InitUnit,
    base_seed: int,
    owners: dict[int, nn.Module],
    adapters: dict[int, Callable[[], None]] | None = None,
) -> dict[int, torch.Tensor]:
    """``id`` of each tensor of ``unit`` -> its initial values (on the CPU); the unit's tensors are not touched.

    ``owners``: ``id(module)`` -> the transformers ``PreTrainedModel`` whose ``_init_weights`` initialises it
    (:func:`hf_owners`). ``adapters``: ``id`` of a PEFT tuner layer -> its adapters' init, run last
    (:func:`epl.materialize.adapters.adapter_inits`). Raises :class:`UninitializedError` for a tensor nothing
    initialises.
    """
    slots = unit.slots()
    adapters = adapters or {}
    if any(id(module) in owners for _, module in unit.modules):
        try:
            return _initialized(unit, slots, base_seed, owners, adapters, torch_init=False)
        except AdapterInitError:
            raise
        except UninitializedError:
            pass  # transformers' _init_weights leaves a tensor unset: torch's reset_parameters first, then it
    return _initialized(unit, slots, base_seed, owners, adapters, torch_init=True)


def _initialized(
    unit: InitUnit,
    slots: list[tuple[nn.Module, str, str, torch.Tensor]],
    base_seed: int,
    owners: dict[int, nn.Module],
    adapters: dict[int, Callable[[], None]],
    torch_init: bool,
) -> dict[int, torch.Tensor]:
    """The unit's values, checked: no floating tensor left NaN, other tensors the same from two fills."""
    checked_twice = any(not _floating(t) for *_, t in slots)
    first = _run(unit, slots, base_seed, owners, adapters, fill=0, torch_init=torch_init)
    if not checked_twice:
        _require_set(unit, slots, first)
        return first
    second = _run(unit, slots, base_seed, owners, adapters, fill=1, torch_init=torch_init)
    for module, _, name, tensor in slots:
        if not _floating(tensor) and not torch.equal(first[id(tensor)], second[id(tensor)]):
            raise _uninitialized(unit, name, module)
    _require_set(unit, slots, second)
    return second


def _run(
    unit: InitUnit,
    slots: list[tuple[nn.Module, str, str, torch.Tensor]],
    base_seed: int,
    owners: dict[int, nn.Module],
    adapters: dict[int, Callable[[], None]],
    fill: int,
    torch_init: bool,
) -> dict[int, torch.Tensor]:
    """One initialisation of the unit from ``fill`` (NaN for floating tensors); ``torch_init`` False: no
    ``reset_parameters()`` of the modules a transformers model owns."""
    fresh: dict[int, torch.Tensor] = {}
    for *_, tensor in slots:
        if id(tensor) not in fresh:
            value = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
            value.fill_(float("nan") if _floating(tensor) else fill)
            fresh[id(tensor)] = nn.Parameter(value, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else value
    with _in_slots(unit, slots, fresh), torch.no_grad(), _seeded(unit_seed(base_seed, unit.name)):
        for _, module in unit.modules:
            reset = getattr(module, "reset_parameters", None)
            if callable(reset) and (torch_init or id(module) not in owners):
                reset()
        for _, module in reversed(unit.modules):
            owner = owners.get(id(module))
            if owner is not None:
                owner._init_weights(module)  # type: ignore[operator]  # a transformers PreTrainedModel's method
        for _, module in unit.modules:  # PEFT's adapters, as PEFT initialises them (after the model's own init)
            init = adapters.get(id(module))
            if init is not None:
                init()
    return {key: value.detach() for key, value in fresh.items()}


def hf_owners(model: nn.Module) -> dict[int, nn.Module]:
    """``id`` of each module of ``model`` -> the nearest transformers ``PreTrainedModel`` at or above it that has
    an ``_init_weights`` (none for a model without transformers)."""
    owners: dict[int, nn.Module] = {}

    def visit(module: nn.Module, owner: nn.Module | None) -> None:
        if callable(getattr(module, "_init_weights", None)) and hasattr(module, "config"):
            owner = module
        if owner is not None:
            owners[id(module)] = owner
        for child in module.children():
            visit(child, owner)

    visit(model, None)
    return owners


@contextlib.contextmanager
def _in_slots(
    unit: InitUnit, slots: list[tuple[nn.Module, str, str, torch.Tensor]], fresh: dict[int, torch.Tensor]
) -> Iterator[None]:
    """The unit's modules hold the ``fresh`` tensors in place of their own, and their children as built, inside
    the block."""
    current = {id(m): (m, m._modules) for _, m in unit.modules}
    for module, _ in current.values():
        module._modules = dict(unit.children[id(module)])
    now: list[tuple[dict[str, Any], str, torch.Tensor | None]] = []
    for module, attr, _, tensor in slots:
        store: dict[str, Any] = module._parameters if attr in module._parameters else module._buffers
        now.append((store, attr, store.get(attr, _ABSENT)))
        store[attr] = fresh[id(tensor)]
    try:
        yield
    finally:
        for store, attr, held in reversed(now):  # what the slots hold now (a transform's shard, say)
            if held is _ABSENT:
                del store[attr]
            else:
                store[attr] = held
        for module, children in current.values():
            module._modules = children


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """The CPU random stream seeded with ``seed`` inside the block, as it was outside it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _floating(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


def _require_set(
    unit: InitUnit, slots: list[tuple[nn.Module, str, str, torch.Tensor]], values: dict[int, torch.Tensor]
) -> None:
    for module, _, name, tensor in slots:
        if _floating(tensor) and _has_nan(values[id(tensor)]):
            raise _uninitialized(unit, name, module)


def _has_nan(values: torch.Tensor) -> bool:
    """Whether ``values`` holds a NaN. A NaN makes the sum NaN, so the sum (one pass, no allocation: a quarter of
    a Llama's initialisation time went to ``isnan(...).any()``) rules most tensors out; a NaN sum (infinities of
    both signs, or an overflow) is checked element by element."""
    return bool(torch.isnan(values.sum())) and bool(torch.isnan(values).any())


def _uninitialized(unit: InitUnit, name: str, module: nn.Module) -> UninitializedError:
    kind = type(module)
    return UninitializedError(
        f"The model was built on the meta device, and nothing initialises {name!r} (held by a "
        f"{kind.__module__}.{kind.__qualname__}): its module has no reset_parameters() that sets it and no "
        "transformers _init_weights covers it, so EPL cannot give it values. Give the module a reset_parameters() "
        "that sets every tensor it holds itself, or build that module off the meta device (buffers computed at "
        "construction: use the config key model.meta_init, which keeps buffers real, instead of "
        "torch.device('meta'))."
    )
