"""Subclasses of a split layer that add to its ``forward`` (Gemma's scaled embedding): keep what they add.

A rule registered for a base class (``nn.Embedding``, ``nn.Linear``) returns that base's
parallel layer, which would drop whatever a subclass's own ``forward`` does around
``super().forward`` (transformers' Gemma multiplies its embeddings by the square root of
the hidden size there). :func:`with_own_forward` gives the shard a class that runs the
subclass's ``forward`` with ``super().forward`` reaching the parallel layer's: the class
order is the subclass, then the parallel layer, then the base. A subclass whose
``forward`` does not call ``super().forward`` (so it computes with the whole weight
itself) is kept whole (:func:`calls_super_forward`), and one that names ``super`` without calling its
``forward`` is an error at its first call, never a silent wrong result.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from epl.errors import AnnotationError


def overrides_forward(module: nn.Module, base: type[nn.Module]) -> bool:
    """Whether a class between ``type(module)`` and ``base`` defines its own ``forward``."""
    for cls in type(module).__mro__:
        if cls is base:
            return False
        if "forward" in vars(cls):
            return True
    return False


def calls_super_forward(module: nn.Module, base: type[nn.Module]) -> bool:
    """Whether every ``forward`` a class between ``type(module)`` and ``base`` defines names ``super`` (it may
    then reach the parallel layer's); one that does not computes with the weight itself."""
    for cls in type(module).__mro__:
        if cls is base:
            return True
        code = getattr(vars(cls).get("forward"), "__code__", None)
        if code is not None and "super" not in code.co_names:
            return False
    return True


def with_own_forward(original: nn.Module, shard: nn.Module, base: type[nn.Module]) -> nn.Module:
    """``shard`` (a parallel layer made from ``original``, an instance of a subclass of ``base``) as an instance
    of a class that runs ``type(original).forward`` around the parallel layer's ``forward``.

    Raises AnnotationError when ``original`` holds parameters the parallel layer does not replace.
    """
    subclass, parallel = type(original), type(shard)
    extra = sorted({k for k, v in original._parameters.items() if v is not None} - set(shard._parameters))
    if extra:
        raise AnnotationError(
            f"{subclass.__qualname__} adds the parameters {extra} to {base.__qualname__}, so EPL cannot tell how "
            f"to shard it. Register a split rule for {subclass.__qualname__} (docs/split.md, 'Writing a rule'), "
            "or create it outside the epl.split scope."
        )
    combined = _combined_class(subclass, parallel, base)
    made = combined.__new__(combined)
    state = dict(original.__dict__)
    state.update({key: value for key, value in shard.__dict__.items() if not key.endswith("hooks")})
    state["_parameters"] = dict(shard._parameters)
    state["_buffers"] = {**original._buffers, **shard._buffers}
    state["_modules"] = {**original._modules, **shard._modules}
    made.__dict__.update(state)
    return made


_CLASSES: dict[tuple[type, type, type], type] = {}


def _combined_class(subclass: type[nn.Module], parallel: type[nn.Module], base: type[nn.Module]) -> type[nn.Module]:
    """The class ``subclass`` -> (``parallel`` before ``base``): ``super().forward`` in the subclass reaches the
    parallel layer's ``forward``, which notes that it ran."""
    key = (subclass, parallel, base)
    if key not in _CLASSES:

        def parallel_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            self.__dict__["_epl_parallel_calls"] = self.__dict__.get("_epl_parallel_calls", 0) + 1
            return parallel.forward(self, *args, **kwargs)

        def checked_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            before = self.__dict__.get("_epl_parallel_calls", 0)
            result = subclass.forward(self, *args, **kwargs)
            if self.__dict__.get("_epl_parallel_calls", 0) == before:
                raise AnnotationError(
                    f"{subclass.__qualname__}.forward does not call super().forward, so under epl.split it would "
                    f"compute with a shard as if it were the whole {base.__qualname__}. Register a split rule for "
                    f"{subclass.__qualname__} (docs/split.md, 'Writing a rule'), or create it outside the "
                    "epl.split scope."
                )
            return result

        shim = type(f"_{parallel.__name__}As{base.__name__}", (parallel, base), {"forward": parallel_forward})
        name = f"{parallel.__name__}[{subclass.__name__}]"
        _CLASSES[key] = type(name, (subclass, shim), {"forward": checked_forward, "__module__": subclass.__module__})
    return _CLASSES[key]
