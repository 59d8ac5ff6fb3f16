"""One config key: its name, accepted types, default, allowed values and documentation."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

_TYPE_NAMES = {bool: "bool", int: "int", float: "float", str: "str", type(None): "None"}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_NONE = {"none", "null", ""}


@dataclass(frozen=True, kw_only=True)
class ConfigKey:
    """A typed config key, as declared by a plugin through ``epl_config_keys``.

    ``types`` lists the accepted Python types (``bool`` is never taken for ``int``).
    ``choices`` restricts string values; ``minimum`` restricts numeric values.
    ``provided_by`` names the plugin (its entry-point name, which is its
    distribution name) that implements the key when the key is declared by
    someone else, e.g. the core declares the manual's ``zero.level`` as provided
    by ``epl-memory``. Setting such a key to a non-default value without that
    plugin installed is an error at ``epl.init``. ``infinite_allowed`` lets a
    float key take ``inf`` (numbers must be finite otherwise).
    """

    name: str
    types: tuple[type, ...]
    default: Any
    doc: str
    choices: tuple[str, ...] | None = None
    minimum: int | float | None = None
    provided_by: str | None = None
    infinite_allowed: bool = False

    def __post_init__(self) -> None:
        if "." not in self.name:
            raise ValueError(f"config key {self.name!r} must look like 'section.attribute'")
        problem = self.problem_with(self.default)
        if problem is not None:
            raise ValueError(f"default of config key {self.name!r} is invalid: {problem}")

    @property
    def section(self) -> str:
        """The part before the dot, e.g. ``pipeline``."""
        return self.name.split(".", 1)[0]

    @property
    def attribute(self) -> str:
        """The part after the dot, e.g. ``num_micro_batch``."""
        return self.name.split(".", 1)[1]

    @property
    def env_var(self) -> str:
        """The environment variable that sets this key, e.g. ``EPL_PIPELINE_NUM_MICRO_BATCH``."""
        return "EPL_" + self.name.upper().replace(".", "_")

    def type_name(self) -> str:
        """The accepted types as the manual writes them, e.g. ``int/str``."""
        return "/".join(_TYPE_NAMES.get(t, t.__name__) for t in self.types)

    def allowed(self) -> str:
        """A human description of the allowed values."""
        parts = []
        if bool in self.types and str in self.types:
            parts.append("any bool")
        if self.choices is not None:
            parts.append("one of " + ", ".join(repr(c) for c in self.choices))
        if self.minimum is not None:
            parts.append(f"a number >= {self.minimum}" + (" (inf included)" if self.infinite_allowed else ""))
        if type(None) in self.types:
            parts.append("None")
        if not parts:
            return f"any {self.type_name()}"
        return " or ".join(parts)

    def problem_with(self, value: Any) -> str | None:
        """Why ``value`` is not valid for this key, or None when it is."""
        if not any(_is_instance(value, t) for t in self.types):
            return f"expected {self.type_name()}, got {value!r} ({type(value).__name__})"
        if isinstance(value, str) and self.choices is not None and value not in self.choices:
            return f"expected {self.allowed()}, got {value!r}"
        if _is_number(value) and not (math.isfinite(value) or (math.isinf(value) and self.infinite_allowed)):
            return f"expected a finite number ({self.allowed()}), got {value!r}"
        if _is_number(value) and self.minimum is not None and value < self.minimum:
            return f"expected {self.allowed()}, got {value!r}"
        return None

    def parse(self, text: str) -> Any:
        """Turn the text of an environment variable into a value of this key's type.

        Raises ``ValueError`` when no accepted type can read the text.
        """
        stripped = text.strip()
        lowered = stripped.lower()
        if type(None) in self.types and lowered in _NONE:
            return None
        if bool in self.types:
            if lowered in _TRUE:
                return True
            if lowered in _FALSE:
                return False
        for kind in (int, float):
            if kind in self.types:
                try:
                    return kind(stripped)
                except ValueError:
                    pass
        if str in self.types:
            return stripped
        raise ValueError(f"cannot read {text!r} as {self.type_name()}")


def _is_instance(value: Any, kind: type) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return _is_number(value)
    return isinstance(value, kind)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
