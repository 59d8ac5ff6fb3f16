"""The names of a checkpoint's entries: each key made by ``format()`` is read back by ``parse()``, and the
format 2 piece names EPL still reads parse as they were written."""

from __future__ import annotations

import pytest

from epl.runtime.checkpoint.keys import (
    Piece,
    StateKey,
    data_key,
    data_rank,
    is_data,
    is_state,
    model_key,
    model_name,
    rng_generator,
    rng_key,
)


@pytest.mark.parametrize(
    "key",
    [
        StateKey("front.0.weight", "exp_avg"),
        StateKey("back.3.bias", "step"),
        StateKey("a.weight", "exp_avg_sq", Piece(0, 2, 0)),
        StateKey("b.weight", "exp_avg", Piece(1, 2, 1)),
        StateKey("blocks.11.mlp.weight", "exp_avg", Piece(3, 4, 1, parts=3)),
        StateKey("dim.weight", "momentum_buffer", Piece(0, 1, 0, parts=1)),  # "dim" in the name: no confusion
    ],
)
def test_a_state_key_is_parsed_back_as_formatted(key: StateKey) -> None:
    assert StateKey.parse(key.format()) == key
    assert is_state(key.format())


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("optim/a.weight/exp_avg", StateKey("a.weight", "exp_avg")),
        ("optim/a.weight/exp_avg/shard0of2dim0", StateKey("a.weight", "exp_avg", Piece(0, 2, 0))),
        ("optim/b.weight/exp_avg_sq/shard1of2dim1", StateKey("b.weight", "exp_avg_sq", Piece(1, 2, 1))),
        ("optim/c.weight/exp_avg/shard2of4dim0parts3", StateKey("c.weight", "exp_avg", Piece(2, 4, 0, 3))),
        ("optim/dims.weight/step/shard10of12dim1", StateKey("dims.weight", "step", Piece(10, 12, 1))),
    ],
)
def test_format_2_piece_names_parse(text: str, expected: StateKey) -> None:
    parsed = StateKey.parse(text)
    assert parsed == expected
    assert parsed.format() == text
    assert parsed.order == (expected.piece.index if expected.piece is not None else 0)


@pytest.mark.parametrize(
    "text",
    ["model/a.weight", "optim/a.weight", "optim/a.weight/exp_avg/shard0of2", "optim//exp_avg", "optim/a/b/c/d"],
)
def test_what_is_no_state_key_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        StateKey.parse(text)


def test_a_piece_name_is_refused_when_malformed() -> None:
    with pytest.raises(ValueError, match="not the name of a piece"):
        Piece.parse("shardXof2dim0")


def test_the_other_keys_are_read_back() -> None:
    assert model_key("front.0.weight") == "model/front.0.weight"
    assert model_name(model_key("front.0.weight")) == "front.0.weight"
    assert model_name("optim/front.0.weight/exp_avg") is None
    assert rng_key(3, "torch") == "rng/3/torch"
    assert rng_generator(rng_key(3, "cuda"), 3) == "cuda"
    assert rng_generator(rng_key(3, "cuda"), 1) is None
    assert rng_generator(rng_key(13, "cuda"), 1) is None
    assert data_key(2) == "data/2" and is_data(data_key(2))
    assert data_rank(data_key(12)) == 12
    assert data_rank("engine/meta") is None
