"""Measuring the activations autograd saves for backward (live and peak bytes, per storage)."""

from __future__ import annotations

import threading
import weakref
from typing import cast

import torch


class SavedActivations:
    """Live and peak bytes of activations that autograd saves for backward, while ``with meter:`` runs.

    A ``saved_tensors_hooks`` pack hook wraps every tensor autograd saves in a small
    ``_Saved`` object, which autograd then holds exactly as long as it would have held
    the tensor: until the backward through that node has run and freed its buffers, or
    until the graph is dropped. A ``weakref.finalize`` on the wrapper marks the release
    whether or not the tensor was ever unpacked; unpacking (possibly more than once)
    changes nothing. The wrapper holds the tensor detached: a saved output holding its
    own ``grad_fn`` would be a reference cycle through autograd's C++ graph, which no
    collector breaks when a graph was kept with ``retain_graph=True`` (zero-bubble's I).

    Bytes are counted per storage, not per saved reference: a ReLU output saved by the
    ReLU and by the next Linear is one buffer in memory, counted (whole storage) once
    while any saved reference to it lives (a reference count per storage; a counted
    storage cannot be freed and its address reused). Storages of ``exclude`` (the
    parameters, and the step's input and target batch) are not counted: they live
    anyway. What remains is the memory a schedule keeps alive for its micro-batches in
    flight, and ``live`` is back to 0 after a complete step.
    """

    def __init__(self, exclude: list[torch.Tensor]) -> None:
        """A meter that does not count the storages of ``exclude``."""
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        from epl.sharding.data_shards import local_tensor

        self._exclude = {local_tensor(t).untyped_storage().data_ptr() for t in exclude}
        self._refs: dict[int, int] = {}
        self._lock = threading.RLock()  # finalizers may run on another thread (or inside a collection)
        self.live = 0
        self.peak = 0

    def __enter__(self) -> SavedActivations:
        """Wrap what autograd saves from now on; the peak starts from the bytes live now."""
        self.peak = self.live
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop wrapping newly saved tensors (those already wrapped are still tracked until released)."""
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: torch.Tensor) -> object:
        """Count ``tensor``'s storage as live and return the wrapper autograd keeps instead of it."""
        storage = tensor.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if key in self._exclude or nbytes == 0:
            return tensor
        with self._lock:
            count = self._refs.get(key, 0)
            self._refs[key] = count + 1
            if count == 0:
                self.live += nbytes
                self.peak = max(self.peak, self.live)
        saved = _Saved(tensor.detach())  # no grad_fn: holding it must not keep the graph alive
        weakref.finalize(saved, self._release, key, nbytes)
        return saved

    @staticmethod
    def _unpack(saved: object) -> torch.Tensor:
        """The saved tensor (autograd may unpack the same wrapper several times)."""
        return saved.tensor if isinstance(saved, _Saved) else cast(torch.Tensor, saved)  # what _pack returned

    def _release(self, key: int, nbytes: int) -> None:
        """Autograd dropped one saved reference to storage ``key``; the last one frees its bytes."""
        with self._lock:
            count = self._refs[key] - 1
            if count:
                self._refs[key] = count
            else:
                del self._refs[key]
                self.live -= nbytes


class _Saved:
    """A saved tensor as autograd holds it while a meter runs (its lifetime is the saved tensor's)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        """Hold ``tensor`` for autograd."""
        self.tensor = tensor
