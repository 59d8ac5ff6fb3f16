"""``epl.replicate``, ``epl.split`` and ``epl.set_default_strategy``: the manual's annotations."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Literal, Protocol

from epl.errors import AnnotationError, NotInitializedError

StrategyKind = Literal["replicate", "split"]


@dataclass(frozen=True)
class Strategy:
    """A parallelism strategy for the modules created inside its scope.

    Use it as a context manager (``with epl.replicate(1): ...``) or pass it to
    :func:`set_default_strategy`. Every ``with`` block and every
    ``set_default_strategy`` call opens one TaskGraph. A module built there also takes
    the unannotated modules it holds (built outside any annotation, or before
    ``epl.init``) into that TaskGraph; modules of another annotation stay in theirs.
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
        active_recorder().open_scope(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        active_recorder().close_scope(self)

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
    if strategy is not None and not isinstance(strategy, Strategy):
        raise AnnotationError(f"set_default_strategy takes epl.replicate(...) or epl.split(...), got {strategy!r}.")
    active_recorder().set_default(strategy)


class ScopeRecorder(Protocol):
    """What the annotations report to: :class:`epl.annotations.capture.AnnotationRecorder`."""

    def open_scope(self, strategy: Strategy) -> None:
        """A ``with`` block of ``strategy`` starts."""
        ...

    def close_scope(self, strategy: Strategy) -> None:
        """The ``with`` block of ``strategy`` ends."""
        ...

    def set_default(self, strategy: Strategy | None) -> None:
        """``set_default_strategy(strategy)`` was called."""
        ...


#: The recorder of the current ``epl.init``; ``epl.init`` sets it, ``Env.close`` clears it.
_active: ContextVar[ScopeRecorder | None] = ContextVar("epl_annotation_recorder", default=None)


def set_active_recorder(recorder: ScopeRecorder | None) -> None:
    """Make ``recorder`` receive the annotations from now on (None: annotations fail as uninitialised)."""
    _active.set(recorder)


def active_recorder() -> ScopeRecorder:
    """The recorder annotations report to; fails when ``epl.init`` has not been called."""
    recorder = _active.get()
    if recorder is None:
        raise NotInitializedError("EPL is not initialised: call epl.init() (or epl.init(epl.Config({...}))) first.")
    return recorder
