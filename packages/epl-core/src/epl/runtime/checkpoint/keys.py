"""The names of a checkpoint's entries, made and read back here only.

``model/<name>``: a model tensor; ``optim/<name>/<state>``: a parameter's optimizer state (:class:`StateKey`;
format 2 stored a split parameter's states as pieces, ``.../shard<i>of<n>dim<d>[parts<p>]``: :class:`Piece`);
``engine/meta``: EPL's own entry; ``rng/<rank>/<generator>``: a rank's generator state; ``data/<rank>``: where a
rank's loaders stood.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: Identifies the layout of the directory. 3: every logical tensor (model and optimizer states alike) is stored as
#: the rectangles its ranks held, at their offsets. 2 (read too): model tensors whole, and a split parameter's
#: states as its pieces, ``optim/<name>/<state>/shard<i>of<n>dim<d>[parts<p>]``.
FORMAT = "epl-checkpoint/3"
#: The formats this version reads.
READABLE = ("epl-checkpoint/2", FORMAT)

#: EPL's own entry: step counter, optimizer options, loss scaler, LR scheduler (JSON).
META = "engine/meta"
_MODEL, _OPTIM, _RNG, _DATA = "model/", "optim/", "rng/", "data/"
_PIECE = re.compile(r"shard(\d+)of(\d+)dim(\d+)(?:parts(\d+))?")


@dataclass(frozen=True)
class Piece:
    """A piece of a split parameter's optimizer state, as format 2 stored it: ``shard<index>of<count>dim<dim>``,
    with ``parts<parts>`` after it when the parameter was split into parts (None: not written)."""

    index: int
    count: int
    dim: int
    parts: int | None = None

    def format(self) -> str:
        """The piece's name (the last part of its key)."""
        return f"shard{self.index}of{self.count}dim{self.dim}" + (
            f"parts{self.parts}" if self.parts is not None else ""
        )

    @classmethod
    def parse(cls, text: str) -> Piece:
        """The piece named ``text``; ValueError when it names none."""
        found = _PIECE.fullmatch(text)
        if found is None:
            raise ValueError(f"{text!r} is not the name of a piece (shard<i>of<n>dim<d>[parts<p>]).")
        index, count, dim, parts = found.groups()
        return cls(int(index), int(count), int(dim), int(parts) if parts is not None else None)


@dataclass(frozen=True)
class StateKey:
    """The key of a parameter's optimizer state: ``optim/<param>/<state>``, or of one ``piece`` of it (format 2)."""

    param: str
    state: str
    piece: Piece | None = None

    def format(self) -> str:
        """The checkpoint key."""
        key = f"{_OPTIM}{self.param}/{self.state}"
        return key if self.piece is None else f"{key}/{self.piece.format()}"

    @classmethod
    def parse(cls, key: str) -> StateKey:
        """The state ``key`` names; ValueError when it names none."""
        parts = key.split("/")
        if parts[0] + "/" != _OPTIM or len(parts) not in (3, 4) or not all(parts[1:]):
            raise ValueError(f"{key!r} is not the key of an optimizer state (optim/<name>/<state>[/<piece>]).")
        return cls(parts[1], parts[2], Piece.parse(parts[3]) if len(parts) == 4 else None)

    @property
    def order(self) -> int:
        """Where the piece goes among its state's pieces (0 for a whole state)."""
        return self.piece.index if self.piece is not None else 0


def is_state(key: str) -> bool:
    """Whether ``key`` is an optimizer state's (:class:`StateKey`)."""
    return key.startswith(_OPTIM)


def model_key(name: str) -> str:
    """The key of the model tensor ``name``."""
    return _MODEL + name


def model_name(key: str) -> str | None:
    """The model tensor's name ``key`` holds (None: not a model tensor's key)."""
    return key[len(_MODEL) :] if key.startswith(_MODEL) else None


def rng_key(rank: int, generator: str) -> str:
    """The key of ``rank``'s state of ``generator``."""
    return f"{_RNG}{rank}/{generator}"


def rng_generator(key: str, rank: int) -> str | None:
    """The generator whose state of ``rank`` ``key`` holds (None: not one of ``rank``'s generator states)."""
    prefix = rng_key(rank, "")
    return key[len(prefix) :] if key.startswith(prefix) else None


def data_key(rank: int) -> str:
    """The key of where ``rank``'s loaders stood."""
    return f"{_DATA}{rank}"


def is_data(key: str) -> bool:
    """Whether ``key`` is a ``data/<rank>`` key."""
    return key.startswith(_DATA)


def data_rank(key: str) -> int | None:
    """The rank whose loaders ``key`` holds (None: not a ``data/<rank>`` key)."""
    return int(key[len(_DATA) :]) if key.startswith(_DATA) else None
