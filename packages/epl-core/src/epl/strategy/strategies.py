"""``epl.replicate``, ``epl.split`` and ``epl.set_default_strategy``: the manual's annotations."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from epl.errors import AnnotationError

StrategyKind = Literal["replicate", "split"]


@dataclass(frozen=True)
class Strategy:
    """A parallelism strategy for the modules created inside its scope.

    Use it as a context manager (``with epl.replicate(1): ...``) or pass it to
    :func:`set_default_strategy`. Every ``with`` block and every
    ``set_default_strategy`` call opens one TaskGraph.
    """

    kind: StrategyKind
    device_count: int
    name: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.device_count, bool) or not isinstance(self.device_count, int) or self.device_count < 1:
            raise AnnotationError(
                f"epl.{self.kind}(device_count=...) needs a positive integer device count, got {self.device_count!r}."
            )
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise AnnotationError(f"epl.{self.kind}(name=...) must be a non-empty string, got {self.name!r}.")

    def __enter__(self) -> Strategy:
        from epl.env import Env

        Env.get().annotations.open_scope(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        from epl.env import Env

        Env.get().annotations.close_scope(self)

    def __str__(self) -> str:
        name = f", name={self.name!r}" if self.name else ""
        return f"{self.kind}({self.device_count}{name})"


def replicate(device_count: int, name: str | None = None) -> Strategy:
    """Data parallelism for the modules created in this scope.

    ``device_count`` devices hold one model replica's copy of these modules; the
    replica batch is split ``device_count`` ways among them. EPL infers the number
    of replicas from the world size.
    """
    return Strategy("replicate", device_count, name)


def split(device_count: int, name: str | None = None) -> Strategy:
    """Tensor (or expert) model parallelism: shard the modules created in this scope over ``device_count`` devices."""
    return Strategy("split", device_count, name)


def set_default_strategy(strategy: Strategy | None) -> None:
    """Apply ``strategy`` to modules created outside any scope from now on.

    Every call opens a new TaskGraph (the manual's BERT example makes one pipeline
    stage per call). ``None`` returns to the implicit ``replicate(1)``.
    """
    from epl.env import Env

    if strategy is not None and not isinstance(strategy, Strategy):
        raise AnnotationError(f"set_default_strategy takes epl.replicate(...) or epl.split(...), got {strategy!r}.")
    Env.get().annotations.set_default(strategy)
