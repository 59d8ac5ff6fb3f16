"""examples/finetune: packed rows keep their documents apart, and the whole path runs on 2 processes.

The packing check runs transformers' Llama on a row of three documents and on each document alone: the row's
logits are the documents' (position ids restarting per document mask attention across them, under ``sdpa`` and
``eager``, without a key-value cache), and its loss is their token-weighted mean. With a cache (the model's
default) transformers 5.23 ignores the restarts: the last test keeps that in sight.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "finetune"
BIN = Path(sys.executable).parent
EPL = shutil.which("epl", path=str(BIN)) or "epl"


def _pack() -> object:
    sys.path.insert(0, str(EXAMPLE))
    try:
        from packing import pack
    finally:
        sys.path.remove(str(EXAMPLE))
    return pack


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_packed_row_is_its_documents_run_one_by_one(attention: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    pack = _pack()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation=attention, use_cache=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config).double().eval()
    documents = [torch.randint(1, 64, (n,)).tolist() for n in (5, 7, 4)]
    rows = pack({"input_ids": documents}, 16)  # type: ignore[operator]
    assert rows["position_ids"] == [list(range(5)) + list(range(7)) + list(range(4))]
    batch = {key: torch.tensor(value) for key, value in rows.items()}
    with torch.no_grad():
        packed = model(**batch)
        alone = [model(input_ids=torch.tensor([d]), labels=torch.tensor([d])) for d in documents]
    # eager attention takes its softmax in float32: 1e-6 (attention crossing a document moves logits by > 0.1)
    torch.testing.assert_close(packed.logits[0], torch.cat([out.logits[0] for out in alone]), rtol=0, atol=1e-6)
    targets = [len(d) - 1 for d in documents]  # each document predicts all but its first token
    expected = sum(out.loss * n for out, n in zip(alone, targets, strict=True)) / sum(targets)
    torch.testing.assert_close(packed.loss, expected, rtol=0, atol=1e-6)  # transformers: the loss in float32


def test_a_document_cut_by_a_row_starts_the_next_row_at_position_0() -> None:
    pack = _pack()
    rows = pack({"input_ids": [list(range(10, 16)), list(range(20, 26))]}, 4)  # type: ignore[operator]
    assert rows["position_ids"] == [[0, 1, 2, 3], [0, 1, 0, 1], [0, 1, 2, 3]]
    assert rows["labels"] == [[-100, 11, 12, 13], [-100, 15, -100, 21], [-100, 23, 24, 25]]


#: The layout line of each run on 2 processes.
LAYOUT_LINES = {
    "split": "layout: rank 0: taskgraph_0 split(2)[shard 0]; rank 1: taskgraph_0 split(2)[shard 1]",
    "pipeline": "layout: rank 0: stage_0 replicate(1); rank 1: stage_1 replicate(1)",
}
#: What the export holds: transformers' format for a full fine-tune, PEFT's adapter format with --lora.
EXPORTED = {"split": {"model.safetensors", "config.json"}, "pipeline": {"adapter_model.safetensors"}}


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize(("layout", "flags"), [("split", []), ("pipeline", ["--lora"])])
def test_the_finetune_example_on_two_processes(tmp_path: Path, layout: str, flags: list[str]) -> None:
    """Pretrained base and tokenizer written, packed text, training (all weights under split(2); LoRA adapters
    on 2 automatic pipeline stages), evaluation, export, generation in plain transformers (and peft)."""
    tiny = ["--steps", "4", "--eval-every", "2", "--eval-batches", "1", "--batch-size", "4", "--seq-len", "64"]
    tiny += ["--documents", "600", "--cache", str(tmp_path / "cache"), "--out", str(tmp_path / "out"), *flags]
    done = subprocess.run(
        [EPL, "launch", "--nproc-per-node", "2", str(EXAMPLE / "train.py"), "--layout", layout, *tiny],
        capture_output=True,
        text=True,
        timeout=170,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"},
        cwd=ROOT,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert LAYOUT_LINES[layout] in out, out
    losses = [float(x) for x in re.findall(r"eval  step +\d+: held-out loss ([\d.]+), perplexity [\d.]+", out)]
    assert len(losses) == 3 and losses[-1] < losses[0], out
    assert re.search(r"\[rank 0\] generate: 'The import statement.+'", out), out
    assert EXPORTED[layout] | {"tokenizer.json"} <= {p.name for p in (tmp_path / "out").iterdir()}
    assert "[rank 1] eval" not in out


def test_with_a_key_value_cache_transformers_lets_attention_cross_the_documents() -> None:
    """Why train.py sets ``use_cache = False``: should transformers honour packing with a cache, this fails."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    model = LlamaForCausalLM(config).double()
    documents = [torch.randint(1, 64, (n,)) for n in (5, 7)]
    ids, positions = torch.cat(documents)[None], torch.cat([torch.arange(5), torch.arange(7)])[None]
    with torch.no_grad():
        second_alone = model(input_ids=documents[1][None]).logits[0]
        cached = model(input_ids=ids, position_ids=positions).logits[0, 5:]
        uncached = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0, 5:]
    torch.testing.assert_close(uncached, second_alone, rtol=0, atol=1e-10)
    assert (cached - second_alone).abs().max() > 1e-3
