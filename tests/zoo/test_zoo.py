"""CI's slice of the model-zoo conformance run: one architecture per mechanism, under every layout.

The slice: a Llama with tied embeddings (tied weights across split stages), Gemma 2 (a scaled
embedding subclass, norms with offsets, soft-capping), T5 and BART (encoder-decoder, a shared
embedding called under other names), Falcon (fused grouped q/k/v, a linear subclass) and
Qwen2-MoE (fused experts, a shared expert). No cell may train to a different model than one
process, crash, or keep most of its parameters whole under split; a refusal must be one clear
EplError. ``nox -s zoo`` runs the whole matrix (docs/models.md).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.zoo.conformance import LAYOUTS, run_layout

pytestmark = pytest.mark.multiprocess

SLICE = ["llama-tied", "gemma2", "t5", "bart", "falcon", "qwen2_moe"]
_REFERENCES: dict[tuple[Any, ...], Any] = {}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_slice_equals_one_process_or_is_refused(layout: str) -> None:
    cells = run_layout(layout, SLICE, _REFERENCES)
    # "whole" too: every architecture of the slice must be sharded under split (Falcon kept every block whole once).
    bad = [f"{c.architecture}: {c.status} {c.message}" for c in cells if c.status in ("wrong", "error", "whole")]
    assert not bad, "\n".join(bad)
