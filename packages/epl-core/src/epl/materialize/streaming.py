"""Example forwards of a model built on ``meta``, with each init unit given values only while it runs.

What runs the whole model once while parallelizing (the split layout, a pipeline's record, the call order of
an automatic partition) enters :func:`epl.sharding.dataflow.forked_rng`, which enters
:meth:`StreamedInit.on_use` when ``epl.parallelize`` made the model's :class:`StreamedInit` active
(:func:`streamed`). Then:

- a module's forward pre-hook gives its init unit values (:func:`epl.materialize.initialize.initialize_unit`),
  and its forward hook takes them back when it returns, so a rank holds the layer running and the layers
  around it, never the model;
- a tensor used outside its unit's forward (T5's ``shared`` embedding, read by its callers) is given values by
  a ``TorchFunctionMode`` when a torch call reads it, until the module running then returns.

The values are those the model will start training from, so the run is the run of the real model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, TypeVar

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from epl.materialize.adapters import adapter_inits
from epl.materialize.heap import FreedMemory
from epl.materialize.initialize import hf_owners, initialize_unit
from epl.materialize.swap import swap_values, to_meta
from epl.materialize.units import InitUnit, has_meta_tensors, init_units, named_tensors, unit_of_tensors
from epl.torch_private import no_torch_function, tree_flatten

Item = TypeVar("Item")
_ACTIVE: ContextVar[StreamedInit | None] = ContextVar("epl_streamed_init", default=None)


class StreamedInit:
    """A model built on ``meta``, its init units, and the job's seed: the values of any of its tensors on demand."""

    def __init__(self, model: nn.Module, base_seed: int, device: torch.device | str = "cpu") -> None:
        self.model = model
        self.base_seed = base_seed
        self.device = torch.device(device)
        self.units = init_units(model)
        #: Qualified name -> tensor of the model as built (before any transform replaced a module).
        self.built = dict(named_tensors(model))
        #: ``id`` of each tensor -> the unit its values come from (the first holding it).
        self.first = unit_of_tensors(self.units)
        self.owners = hf_owners(model)
        self.adapters = adapter_inits(model)
        self._unit_of_module = {id(m): u for u in self.units for _, m in u.modules}
        self._modules = {id(m) for m in model.modules()}

    def values(self, unit: InitUnit) -> dict[int, torch.Tensor]:
        """``id`` of each tensor of ``unit`` -> its initial values (CPU)."""
        return initialize_unit(unit, self.base_seed, self.owners, self.adapters)

    def by_unit(self, items: list[Item], original: Callable[[Item], torch.Tensor]) -> list[tuple[InitUnit, list[Item]]]:
        """``items`` grouped by the unit that gives ``original(item)`` (a tensor of the model as built) its values,
        in the units' order."""
        groups: dict[int, list[Item]] = {}
        for item in items:
            groups.setdefault(id(self.first[id(original(item))]), []).append(item)
        return [(unit, groups[id(unit)]) for unit in self.units if id(unit) in groups]

    def covers(self, model: nn.Module) -> bool:
        """Whether ``model`` is this model or one of its modules."""
        return id(model) in self._modules

    @contextlib.contextmanager
    def on_use(self) -> Iterator[None]:
        """Inside the block, a forward of the model gives each unit values while it runs (see the module doc)."""
        live = _Live(self)
        handles = [
            nn.modules.module.register_module_forward_pre_hook(live.before),
            nn.modules.module.register_module_forward_hook(live.after, always_call=True),
        ]
        try:
            with _OnTouch(live):
                yield
        finally:
            for handle in handles:
                handle.remove()
            live.release_all()

    def unit_of(self, module: nn.Module) -> InitUnit | None:
        """The unit ``module`` belongs to (None: a module outside the model, or one holding no tensors)."""
        return self._unit_of_module.get(id(module))


class _Live:
    """The tensors given values during one example forward, and which running module gave them."""

    def __init__(self, stream: StreamedInit) -> None:
        self.stream = stream
        self.frames: list[list[torch.Tensor]] = [[]]
        self.live: set[int] = set()
        self.kept: list[torch.Tensor] = []  # could not be taken back when their module returned
        self.heap = FreedMemory()

    def before(self, module: nn.Module, args: Any) -> None:
        self.frames.append([])
        unit = self.stream.unit_of(module)
        if unit is not None:
            self.give(unit.tensors())

    def after(self, module: nn.Module, args: Any, output: Any) -> None:
        if len(self.frames) > 1:
            self.release(self.frames.pop())

    def give(self, tensors: list[torch.Tensor]) -> None:
        """Give values to those of ``tensors`` that are the model's and still on ``meta``.

        Out of sight of the torch function modes of the example run (the split layout's recorder, a pipeline's
        record): initialising a layer is no computation of the model's, and a record that saw it would analyse
        the initialisation's operations as the model's. Even reading ``tensor.is_meta`` passes through those
        modes (and through :class:`_OnTouch`, which would give each tensor alone, initialising its unit once per
        tensor). A unit's values go to all of its tensors still on meta, not only those asked for.
        """
        with no_torch_function():
            wanted = [t for t in tensors if self._waiting(t)]
            for unit, _ in self.stream.by_unit(wanted, lambda tensor: tensor):
                values = self.stream.values(unit)
                for tensor in unit.tensors():
                    if self._waiting(tensor) and self.stream.first[id(tensor)] is unit:
                        swap_values(tensor, values[id(tensor)].to(self.stream.device))
                        self.live.add(id(tensor))
                        self.frames[-1].append(tensor)

    def _waiting(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is the model's and still waits for its values."""
        return tensor.is_meta and id(tensor) in self.stream.first and id(tensor) not in self.live

    def release(self, tensors: list[torch.Tensor]) -> None:
        """Take the values of ``tensors`` back (out of sight of the example run's modes, as :meth:`give`)."""
        with no_torch_function():
            for tensor in tensors:
                self.live.discard(id(tensor))
                nbytes = tensor.nbytes
                if to_meta(tensor):
                    self.heap.freed(nbytes)
                else:
                    self.kept.append(tensor)

    def release_all(self) -> None:
        for frame in self.frames:
            self.release(frame)
        self.frames = [[]]
        kept, self.kept = self.kept, []
        for tensor in kept:
            to_meta(tensor)  # a record that held a view of it is gone by now; if not, its values stay
        self.heap.trim()


class _OnTouch(TorchFunctionMode):
    """Gives values to the model's ``meta`` tensors a torch call reads outside their unit's forward."""

    def __init__(self, live: _Live) -> None:
        super().__init__()
        self.live = live

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        leaves, _ = tree_flatten((args, kwargs))
        touched = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_meta]
        if touched:
            self.live.give(touched)
        return func(*args, **kwargs)


@contextlib.contextmanager
def streamed(stream: StreamedInit | None) -> Iterator[None]:
    """Make ``stream`` the model whose example forwards :func:`active_stream` streams inside the block."""
    token = _ACTIVE.set(stream)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_stream(model: nn.Module) -> StreamedInit | None:
    """The active :class:`StreamedInit` of ``model`` (or of a model holding it), if any."""
    stream = _ACTIVE.get()
    return stream if stream is not None and stream.covers(model) else None


def shapes_only(model: nn.Module) -> bool:
    """Whether an example run of ``model`` computes shapes only: it is built on ``meta`` and no
    :class:`StreamedInit` gives it values (``epl plan``). Such a run fails where the model's code reads values it
    computed from its weights; what depends on it then falls back on what needs no run."""
    return active_stream(model) is None and has_meta_tensors(model)
