"""Module attributes imported on first use (PEP 562): how ``epl`` and ``epl.plugin_api`` stay light to import."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any


def lazy_exports(
    module: str, exports: Mapping[str, str], namespace: MutableMapping[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``module``, which exports ``name`` from ``exports[name]``.

    ``exports`` maps each public name to the module it lives in; a name mapped to ``module``
    itself is its submodule (``epl.io``). A name is imported when first read, then kept in
    ``namespace`` (the module's ``globals()``) so later reads cost nothing.
    """

    def getattr_(name: str) -> Any:
        source = exports.get(name)
        if source is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        if source == module:
            value = importlib.import_module(f"{module}.{name}")
        else:
            value = getattr(importlib.import_module(source), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted([*namespace, *exports])

    return getattr_, dir_
