"""``compile.enabled`` under every layout, on transformers' Llama, against the same script eager in one process.

With the ``aot_eager`` backend (dynamo's capture and AOTAutograd's differentiation, no generated code) in float64,
the losses and every parameter after 3 AdamW steps are equal to 1e-10: compiling changes nothing EPL does around
the blocks (data parallelism's gradient hooks, ZeRO's fetches, split's collectives, the pipeline schedules,
checkpointing's recomputation). Under ZeroBubble the blocks stay eager, named in the report. With ``inductor``
in float32 they are equal within float32 tolerance. CI runs a slice of the layouts that covers each mechanism with
``aot_eager``; its inductor run is ``benchmarks/test_compile.py`` (``compile.enabled`` with inductor in one process,
its first loss against eager's), since inductor's first compilation costs about 25 s of CI on a fresh machine.
``nox -s compile`` runs every layout here with ``inductor`` (``EPL_COMPILE_BACKEND=inductor``).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.multiprocess

STEPS, BATCH, SEQUENCE, VOCABULARY = 3, 4, 16, 64
PIPELINE = {"pipeline.num_stages": 2, "auto.auto_parallel": True, "pipeline.num_micro_batch": 2}
#: Layout name -> (annotation, config, processes).
LAYOUTS: dict[str, tuple[str | None, dict[str, Any], int]] = {
    "data parallel": (None, {}, 2),
    "data parallel, checkpointing": (None, {"gradient_checkpoint.type": "auto"}, 2),
    "data parallel, selective checkpointing": (None, {"gradient_checkpoint.type": "selective"}, 2),
    "ZeRO v1": (None, {"zero.level": "v1"}, 2),
    "ZeRO v2": (None, {"zero.level": "v2"}, 2),
    "split(2)": ("split", {}, 2),
    "split(2), checkpointing": ("split", {"gradient_checkpoint.type": "auto"}, 2),
    "split(2), sequence parallel": ("split", {"split.sequence_parallel": True}, 2),
    "2 stages, 1F1B": (None, {**PIPELINE, "pipeline.strategy": "PreferBackward"}, 2),
    "2 stages, ZeroBubble": (None, {**PIPELINE, "pipeline.strategy": "ZeroBubble"}, 2),
    "split(2) x 2 stages": ("split", PIPELINE, 4),
    "context 2": (None, {"context.degree": 2}, 2),
}
BACKEND = os.environ.get("EPL_COMPILE_BACKEND", "aot_eager")
#: What CI runs: data parallelism's hooks with checkpointing, ZeRO's fetches, split's collectives with
#: checkpointing, the split backward of ZeroBubble, 3D, and context parallelism's attention.
CI_SLICE = ["data parallel, checkpointing", "data parallel, selective checkpointing", "ZeRO v2",
            "split(2), checkpointing", "2 stages, 1F1B", "2 stages, ZeroBubble", "split(2) x 2 stages",
            "context 2"]  # fmt: skip
#: Float32 tolerance for inductor's kernels over 3 AdamW steps; float64 and aot_eager: exact to rounding.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5}


def llama(dtype: torch.dtype) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCABULARY, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa",
    )  # fmt: skip
    return LlamaForCausalLM(config).to(dtype)


def batches() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    found = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCABULARY, (BATCH, SEQUENCE), generator=generator)
        found.append({"input_ids": tokens})
    return found


def next_token_loss(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy in the model's dtype (transformers' own loss is float32 even for a float64 model)."""
    logits = outputs.logits if hasattr(outputs, "logits") else outputs[0]
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), targets[:, 1:].flatten())


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def train(name: str | None, backend: str | None, dtype: torch.dtype) -> dict[str, Any]:
    """Layout ``name`` (None: one process, no annotation) with ``backend`` (None: eager): losses, whole state."""
    import epl

    annotation, config, _ = LAYOUTS[name] if name else (None, {}, 1)
    compiled = {"compile.enabled": True, "compile.backend": backend} if backend else {}
    epl.init(epl.Config({**config, **compiled}))
    if annotation == "split":
        with epl.split(2):
            model = llama(dtype)
    else:
        model = llama(dtype)
    engine = epl.parallelize(model, optimizer=adamw, loss_fn=next_token_loss)
    losses = [float(engine.step(batch, batch["input_ids"])) for batch in batches()]
    report = engine.compile_report
    return {
        "losses": losses,
        "state": engine.state_dict(full=True)["model"],
        "report": None if report is None else (report.compiled, report.graphs, report.eager),
        "directions": None if report is None else (report.forward_graphs, report.backward_graphs),
    }


def check(name: str, backend: str, dtype: torch.dtype) -> None:
    expected = train(None, None, dtype)
    tolerance = TOLERANCE[dtype]
    for rank, found in enumerate(run_ranks(train, LAYOUTS[name][2], name, backend, dtype, timeout=500)):
        compiled, graphs, eager = found["report"]
        if "ZeroBubble" in name:  # its split backward would run a compiled block's backward twice: kept eager
            assert not compiled and "zero bubble" in eager["every block"], found["report"]
        else:
            assert compiled and not eager, (rank, found["report"])
        if name.startswith("split"):  # its collectives traced: each block one graph (docs/compile.md)
            assert graphs == {"LlamaDecoderLayer": 1}, (rank, graphs)
            one = {"LlamaDecoderLayer": 1}  # AOTAutograd's split of it: one forward graph, one backward graph
            assert found["directions"] == (one, one), (rank, found["directions"])
        torch.testing.assert_close(found["losses"], expected["losses"], rtol=tolerance, atol=tolerance)
        for key, value in found["state"].items():
            torch.testing.assert_close(value, expected["state"][key], rtol=tolerance, atol=tolerance, msg=key)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(LAYOUTS) if BACKEND == "inductor" else CI_SLICE)
def test_compiled_blocks_train_as_one_eager_process(name: str) -> None:
    dtype = torch.float64 if BACKEND == "aot_eager" else torch.float32
    check(name, BACKEND, dtype)
