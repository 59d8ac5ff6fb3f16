"""What every package's view of its own config keys shares: built once per :class:`~epl.config.Config`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Self

if TYPE_CHECKING:
    from epl.config.config import Config


class ConfigView(ABC):
    """Base of a package's frozen, typed view of its keys (a frozen dataclass that defines :meth:`read`).

    ``View.from_config(config)`` reads the keys once per ``config`` (``Config.derived``) and returns the same
    object afterwards. The view's module is the one place its package reads those keys by name.
    """

    @classmethod
    def from_config(cls, config: Config) -> Self:
        """The view of ``config``: built by :meth:`read` on the first call, the same object afterwards."""
        view: Self = config.derived(f"{cls.__module__}.{cls.__qualname__}", lambda: cls.read(config))
        return view

    @classmethod
    @abstractmethod
    def read(cls, config: Config) -> Self:
        """A new view of ``config``'s values (each key read by name, here only)."""
