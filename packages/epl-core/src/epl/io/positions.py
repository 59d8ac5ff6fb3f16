"""Where each ``epl.io`` loader stands in its data, for checkpoints: recorded by ``engine.save``, restored by
``engine.load`` on any number of replicas.

The samplers are matched by their order of creation, which the ranks share since they build the same loaders. A
checkpoint holds the state (:meth:`ReplicaSampler.state_dict`: epoch, samples consumed over all replicas, the
shuffling seed...) of each :class:`~epl.io.ReplicaSampler` of the rank that still exists, in the order they were
built since ``epl.init`` (``order`` 0, 1, ...; a loader built for one epoch and dropped is gone). Loading merges the
saving ranks' states by order, checks them against the samplers that exist (in the order they were built), and
restores them; the states left over wait here and are applied, in order, to the samplers built next (the loaders
built after the load).
"""

from __future__ import annotations

import sys
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol

from epl.errors import EplError

if TYPE_CHECKING:
    from epl.runtime.env import Env

#: What a sampler's state records about its data (a loader that reads other data cannot resume the position).
DATA_FIELDS = ("dataset_length", "shuffle", "seed", "drop_last")


class Positioned(Protocol):
    """What the registry keeps of a sampler (:class:`~epl.io.ReplicaSampler`)."""

    def state_dict(self) -> dict[str, Any]:
        """Where the sampler stands."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a :meth:`state_dict`."""
        ...

    def resume_problem(self, state: dict[str, Any]) -> str | None:
        """Why ``state`` cannot be resumed exactly by this sampler (None: it can)."""
        ...


@dataclass
class _Registry:
    """The samplers built under one ``epl.init`` (by order of creation), and restored states waiting for theirs."""

    env: weakref.ref[Env] | None
    samplers: list[weakref.ref[Positioned]] = field(default_factory=list)
    #: (state, strict) restored by engine.load for the samplers built next, in order.
    waiting: list[tuple[dict[str, Any], bool]] = field(default_factory=list)
    #: Samplers already warned about (in a DataLoader of the user's, saved mid-pass), by id.
    warned: set[int] = field(default_factory=set)

    def live(self) -> list[Positioned]:
        """The samplers that still exist, in the order they were built."""
        return [sampler for sampler in (ref() for ref in self.samplers) if sampler is not None]


_registry: _Registry | None = None


def _current() -> _Registry:
    """The registry of the current ``epl.init`` (a new one after each)."""
    from epl.runtime.env import Env

    global _registry
    env = Env._current
    if _registry is None or (_registry.env() if _registry.env is not None else None) is not env:
        _registry = _Registry(weakref.ref(env) if env is not None else None)
    elif env is None and _registry.env is not None:  # its Env was closed and collected: a new start
        _registry = _Registry(None)
    return _registry


def register(sampler: Positioned) -> None:
    """Record ``sampler`` (built now), and restore the next position a load left waiting (raising
    :class:`epl.EplError` when it cannot be resumed exactly, unless the load was not strict)."""
    registry = _current()
    registry.samplers = [ref for ref in registry.samplers if ref() is not None]
    registry.samplers.append(weakref.ref(sampler))
    if registry.waiting:
        state, strict = registry.waiting.pop(0)
        _restore(sampler, state, strict)


def saved() -> list[dict[str, Any]]:
    """The states to checkpoint: every live sampler's, and the restored states still waiting for their sampler
    (it has not moved since the load)."""
    registry = _current()
    states = []
    for sampler in registry.live():
        state = sampler.state_dict()
        states.append(state)
        if _mid_pass(state) and not state["counted"] and id(sampler) not in registry.warned:
            registry.warned.add(id(sampler))
            warnings.warn(
                f"engine.save: the epl.io.ReplicaSampler over {state['dataset_length']} samples is not in a loader "
                "from epl.io.data_loader, so EPL cannot tell which of the indices it handed out were trained on (a "
                "DataLoader's workers fetch ahead); engine.load will refuse to resume it mid-epoch. Build the loader "
                "with epl.io.data_loader (it takes DataLoader's options).",
                stacklevel=_user_level(),
            )
    states += [state for state, _ in registry.waiting]
    return [{**state, "order": order} for order, state in enumerate(states)]


def restore_problem(by_rank: dict[int, list[dict[str, Any]]], strict: bool) -> str | None:
    """Why the positions a checkpoint's ranks saved (``by_rank``) cannot be restored here (None: they can). Not
    strict: nothing (what cannot be resumed is started afresh, with a warning)."""
    if not strict:
        return None
    merged, problems = _merge(by_rank)
    if problems:
        return problems[0]
    for sampler, state in zip(_current().live(), merged, strict=False):
        problem = sampler.resume_problem(state)
        if problem is not None:
            return problem
    return None


def restore(by_rank: dict[int, list[dict[str, Any]]], strict: bool) -> None:
    """Resume every sampler built so far from the checkpoint's positions, and keep the others' positions until
    their samplers are built (they replace what an earlier load left waiting)."""
    merged, problems = _merge(by_rank)
    registry = _current()
    for problem in problems:
        _skip(problem, strict)
    live = registry.live()
    for sampler, state in zip(live, merged, strict=False):
        _restore(sampler, state, strict)
    registry.waiting = [(state, strict) for state in merged[len(live) :]]


def _restore(sampler: Positioned, state: dict[str, Any], strict: bool) -> None:
    problem = sampler.resume_problem(state)
    if problem is None:
        sampler.load_state_dict(state)
    else:
        _skip(problem, strict)


def _skip(problem: str, strict: bool) -> None:
    if strict:
        raise EplError(problem)
    problem = problem.replace(", or pass strict=False to engine.load to start it afresh", "")
    warnings.warn(f"engine.load(strict=False): {problem} It starts afresh.", stacklevel=_user_level())


def _user_level() -> int:
    """The ``stacklevel`` of a warning that points at the first caller outside the ``epl`` package."""
    package, level = str(Path(__file__).resolve().parents[1]), 2
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def _merge(by_rank: dict[int, list[dict[str, Any]]]) -> tuple[list[dict[str, Any]], list[str]]:
    """One state per order of creation from the saving ranks' states (a loader whose ranks disagree: a fresh
    state holds its place), and the disagreements."""
    grouped: dict[int, list[tuple[int, dict[str, Any]]]] = {}
    for rank, states in sorted(by_rank.items()):
        for state in states:
            grouped.setdefault(int(state["order"]), []).append((rank, state))
    merged, problems = [], []
    for _, entries in sorted(grouped.items()):
        (first_rank, first), others = entries[0], entries[1:]
        problem = None
        for rank, state in others:
            if [state[key] for key in DATA_FIELDS] != [first[key] for key in DATA_FIELDS]:
                problem = (
                    f"The checkpoint's {describe(first)} read other data on rank {rank} ({describe(state)}): the "
                    "ranks must build the same epl.io loaders in the same order."
                )
                break
            if where(state) != where(first):
                problem = (
                    f"The checkpoint's {describe(first)} was at different places on the ranks that saved it (rank "
                    f"{first_rank}: {at(first)}; rank {rank}: {at(state)}), so EPL cannot resume it exactly (a "
                    "loader only some ranks walk, saved in the middle of a pass?). Save when every rank is at the "
                    "same place in it, or pass strict=False to engine.load to start it afresh."
                )
                break
        if problem is not None:
            problems.append(problem)
            first = {**first, "epoch": 0, "position": 0, "in_pass": False}  # not strict: it starts afresh
        merged.append(first)
    return merged, problems


def _mid_pass(state: dict[str, Any]) -> bool:
    return bool(state["in_pass"]) and int(state["position"]) > 0


def where(state: dict[str, Any]) -> tuple[int, int]:
    """(epoch, samples of it consumed over all replicas; 0 when no pass is under way)."""
    return int(state["epoch"]), int(state["position"]) if _mid_pass(state) else 0


def at(state: dict[str, Any]) -> str:
    """Where ``state`` stands, in words."""
    epoch, position = where(state)
    return f"epoch {epoch}, {position} of {state['dataset_length']} samples consumed"


def describe(state: dict[str, Any]) -> str:
    """Which loader ``state`` is of, in words."""
    data = (
        f"a dataset of {state['dataset_length']} samples, shuffle={state['shuffle']}, seed={state['seed']}, "
        f"drop_last={state['drop_last']}"
    )
    if "order" not in state:  # a state_dict handed to load_state_dict by hand
        return f"epl.io loader ({data})"
    order = int(state["order"]) + 1
    suffix = {1: "st", 2: "nd", 3: "rd"}.get(order % 10 if order % 100 not in (11, 12, 13) else 0, "th")
    return f"{order}{suffix} epl.io loader (in the order built; {data})"
