"""CI's slice of the model-zoo conformance run: one architecture per mechanism, under every layout.

The slice: a Llama with tied embeddings (tied weights across split stages), Gemma 2 (a scaled
embedding subclass, norms with offsets, soft-capping), Gemma 3 (a forward that loops over a set: the
ranks' call orders agree), T5 and BART (encoder-decoder, a shared
embedding called under other names), Falcon with its grouped layout (`falcon-40b`: fused q/k/v by
key/value group, a linear subclass),
BERT (an LM head holding its decoder's bias) and Qwen2-MoE (fused experts, a shared expert). The meta layouts
build each on the meta device (:mod:`epl.materialize`). Every cell must equal one process with each rank
holding only its share: none may train to a different model, crash, be refused or keep most of
its parameters whole under split. Of the LoRA layouts (PEFT's LoRA on every linear layer), the slice runs
``LoRA split(2)``. ``nox -s zoo`` runs the whole matrix (docs/models.md).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.zoo.conformance import LAYOUTS, run_layout

pytestmark = pytest.mark.multiprocess

SLICE = ["llama-tied", "gemma2", "gemma3_text", "t5", "bart", "bert", "falcon-40b", "qwen2_moe"]
#: The LoRA layouts of the slice (the others run in ``nox -s zoo``): PEFT's wrappers under split.
LORA = ["LoRA split(2)"]
_REFERENCES: dict[tuple[Any, ...], Any] = {}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", [name for name, layout in LAYOUTS.items() if not layout.lora or name in LORA])
def test_the_slice_equals_one_process_or_is_refused(layout: str) -> None:
    cells = run_layout(layout, SLICE, _REFERENCES)
    # Every architecture of the slice trains, sharded under split (Falcon kept every block whole once); context
    # parallelism refuses what its attention cannot spread (encoder-decoders, soft-capped scores) with an error.
    allowed = {"ok", "refused"} if LAYOUTS[layout].context_parallel else {"ok"}
    bad = [f"{c.architecture}: {c.status} {c.message}" for c in cells if c.status not in allowed]
    assert not bad, "\n".join(bad)
    assert any(c.status == "ok" for c in cells)
