"""The GPU MFU suite's modes (``benchmarks/mfu.py``) on a tiny Llama on the CPU: each side runs, and the two sides'
first losses agree, so a GPU loan never finds the suite broken. Float8 needs torchao (skipped without it)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import mfu

TINY = {"hidden": 64, "layers": 3, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocabulary": 256}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", mfu.MODES)
def test_each_mode_runs_and_both_sides_agree(mode: str) -> None:
    if mode == "float8":
        pytest.importorskip("torchao")
    run = dict(shape=TINY, batch=2, sequence=32, device="cpu", steps=1, warmup=1, backend="aot_eager")
    plain = mfu.run_mode(mode, "plain", **run)
    engine = mfu.run_mode(mode, "epl", **run)
    assert engine.first_loss == pytest.approx(plain.first_loss, rel=1e-2)
    assert plain.seconds > 0 and engine.seconds > 0


def test_linear_cross_entropy_equals_the_logits_loss() -> None:
    """In float64, chunked or not, it is transformers' shifted cross-entropy of the logits."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 9, 8, dtype=torch.float64), torch.randn(50, 8, dtype=torch.float64)
    labels = torch.randint(0, 50, (2, 9))
    expected = torch.nn.functional.cross_entropy((hidden @ weight.T).flatten(0, 1), labels.flatten())
    chunk, mfu.CHUNK = mfu.CHUNK, 4
    try:
        got = mfu.chunked_linear_cross_entropy(hidden, weight, labels)
    finally:
        mfu.CHUNK = chunk
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
