"""Pipelines of unmodified transformers models, and 3D: tensor parallel stages, data parallel over them.

The models are transformers' own classes with tiny configs and random weights (nothing is
downloaded): ``LlamaForCausalLM``, ``BertForMaskedLM`` and ``MixtralForCausalLM``, float64,
no dropout, no wrapper. torch.fx cannot trace their ``forward``, so every stage runs the
model's own ``forward`` (EPL's replayed stages); whatever the model returns (a ``ModelOutput``)
reaches the loss on the last stage.

Every run trains 4 AdamW steps of 2 micro-batches per replica with clipping on and is compared
with the same model trained in one process (same seed, same batches): losses, the gradient norm
of every step and every parameter within 1e-10 (float64). Each rank holds only its stage's
(shard of its) parameters.

- auto-cut into 2 stages on 2 processes: Llama, BERT, Mixtral;
- Llama as ``epl.split(2)`` x 2 stages on 4 processes; the checkpoint it saves loads into the
  unmodified model in one process, under its original names;
- Llama as split(2) x 2 stages x 2 replicas on 8 processes, with ZeRO v1 over the replicas;
- Llama cut into 4 stages run 2 per rank by Interleaved1F1B, whole (2 processes) and split(2) (4 processes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import (  # offline: tests/models/__init__.py
    BertConfig,
    BertForMaskedLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
)

from tests.helpers.distributed import run_ranks
from tests.helpers.reference import assert_rank_matches, pipeline_rank_result

pytestmark = pytest.mark.multiprocess

VOCABULARY, SEQUENCE, REPLICA_ROWS, STEPS, MICRO = 64, 8, 4, 4, 2
MAX_NORM = 0.5
TOLERANCE = 1e-10


def llama() -> nn.Module:
    """A 4-layer Llama: grouped-query attention (4 heads, 2 key/value heads), SwiGLU, untied head."""
    config = LlamaConfig(
        vocab_size=VOCABULARY,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQUENCE,
        tie_word_embeddings=False,
        use_cache=False,
    )
    return LlamaForCausalLM(config)


def bert() -> nn.Module:
    """A 4-layer BERT with its masked-language-model head (untied), no dropout."""
    config = BertConfig(
        vocab_size=VOCABULARY,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=SEQUENCE,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        tie_word_embeddings=False,
    )
    return BertForMaskedLM(config)


def mixtral() -> nn.Module:
    """A 4-layer Mixtral: 4 experts, top-2 routing, eager expert products (float64)."""
    config = MixtralConfig(
        vocab_size=VOCABULARY,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=SEQUENCE,
        tie_word_embeddings=False,
        use_cache=False,
        experts_implementation="eager",
    )
    return MixtralForCausalLM(config)


MODELS = {"llama": llama, "bert": bert, "mixtral": mixtral}


def build(name: str, split: int = 1, replicate: int = 1) -> nn.Module:
    """Model ``name`` in float64 from seed 0, built in an ``epl.split(split)`` scope when ``split > 1``, in an
    ``epl.replicate(replicate)`` scope when ``replicate > 1``."""
    import epl

    torch.manual_seed(0)
    if split > 1 or replicate > 1:
        with epl.split(split) if split > 1 else epl.replicate(replicate):
            model = MODELS[name]()
    else:
        model = MODELS[name]()
    return model.double()


def token_loss(outputs: Any, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of every position's logits against the tokens (the model's ModelOutput reaches it)."""
    return nn.functional.cross_entropy(outputs.logits.flatten(0, 1), tokens.flatten())


def batches(replicas: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    rows = replicas * REPLICA_ROWS
    return [torch.randint(0, VOCABULARY, (rows, SEQUENCE), generator=generator) for _ in range(STEPS)]


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def train(
    name: str, config: dict[str, Any], split: int = 1, save_to: str | None = None, replicate: int = 1
) -> dict[str, Any]:
    """One rank: train model ``name`` with EPL; its stage, replica, losses, norms, held and whole parameters."""
    import epl

    settings = {"pipeline.num_micro_batch": MICRO, "optimizer.max_grad_norm": MAX_NORM, **config}
    epl.init(epl.Config(settings))
    engine = epl.parallelize(build(name, split, replicate), optimizer=adamw, loss_fn=token_loss)
    losses, norms = [], []
    for tokens in batches(engine.num_replicas):
        rows = tokens[engine.replica_index * REPLICA_ROWS : (engine.replica_index + 1) * REPLICA_ROWS]
        losses.append(float(engine.step({"input_ids": rows}, rows)))
        norms.append(engine.grad_norm)
    if save_to is not None:
        engine.save(save_to)
    return pipeline_rank_result(engine, losses, norms)


def train_here(
    name: str, replicas: int = 1, *, after_average: bool = False
) -> tuple[list[float], list[list[float]], dict[str, torch.Tensor]]:
    """The one-process reference: each replica's rows in ``MICRO`` micro-batches, its gradient clipped on its own
    (clipping before the all-reduce, the default), the replicas' gradients averaged, one AdamW step;
    ``after_average``: the average clipped by its own norm instead (ZeRO, ``communication.clip_after_allreduce``).

    Returns the replicas' mean loss and each replica's gradient norm of every step, and the parameters.
    """
    model = build(name)
    params = list(model.parameters())
    optimizer = adamw(params)
    losses: list[float] = []
    norms: list[list[float]] = [[] for _ in range(replicas)]
    for tokens in batches(replicas):
        mean = [torch.zeros_like(p) for p in params]
        parts = []
        for replica in range(replicas):
            optimizer.zero_grad()
            for part in tokens[replica * REPLICA_ROWS : (replica + 1) * REPLICA_ROWS].chunk(MICRO):
                loss = token_loss(model(input_ids=part), part)
                (loss / MICRO).backward()
                parts.append(loss.detach())
            if not after_average:
                norms[replica].append(float(nn.utils.clip_grad_norm_(params, MAX_NORM)))
            for total, param in zip(mean, params, strict=True):
                if param.grad is not None:
                    total += param.grad / replicas
        for total, param in zip(mean, params, strict=True):
            param.grad = total if param.grad is not None else None  # unused parameters keep no gradient
        if after_average:
            norm = float(nn.utils.clip_grad_norm_(params, MAX_NORM))
            for replica in range(replicas):
                norms[replica].append(norm)
        optimizer.step()
        losses.append(float(torch.stack(parts).mean()))
    return losses, norms, {k: v.clone() for k, v in model.state_dict().items()}


def every_auto_cut_model() -> dict[str, dict[str, Any]]:
    """On each of 2 ranks: Llama, BERT and Mixtral cut automatically into 2 stages."""
    config = {"auto.auto_parallel": True, "pipeline.num_stages": 2}
    return {name: train(name, config) for name in MODELS}


@pytest.fixture(scope="module")
def auto_cut() -> list[dict[str, dict[str, Any]]]:
    return run_ranks(every_auto_cut_model, 2, timeout=300)


def _assert_equal_to_local(results: list[dict[str, Any]], name: str, replicas: int = 1) -> None:
    losses, norms, full = train_here(name, replicas)
    stages = {result["stage"] for result in results}
    held = [k for result in results if result["replica"] == 0 for k in result["state"]]
    assert sorted(set(held)) == sorted(full)  # the original names, every parameter on some stage
    for result in results:
        assert_rank_matches(result, losses, full, TOLERANCE)
        torch.testing.assert_close(result["norms"], norms[0], rtol=TOLERANCE, atol=0)
    assert stages == {0, 1}


@pytest.mark.parametrize("name", list(MODELS))
def test_unmodified_models_cut_automatically_into_2_stages_equal_the_local_run(
    auto_cut: list[dict[str, Any]], name: str
) -> None:
    results = [ranks[name] for ranks in auto_cut]
    _assert_equal_to_local(results, name)
    total = sum(p.numel() for p in build(name).parameters())
    assert sum(result["held"] for result in results) == total  # each rank holds only its stage
    assert all(result["held"] < total * 0.75 for result in results)  # balanced: neither stage holds it all


@pytest.fixture(scope="module")
def three_d(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    """Llama as split(2) x 2 stages on 4 processes (auto-cut), saving a checkpoint at the end."""
    folder = tmp_path_factory.mktemp("llama-tp2-pp2") / "checkpoint"
    config = {"auto.auto_parallel": True, "pipeline.num_stages": 2}
    return run_ranks(train, 4, "llama", config, 2, str(folder), timeout=300), folder


def test_llama_split_2_by_2_stages_equals_the_local_run(three_d: tuple[list[dict[str, Any]], Path]) -> None:
    results, _ = three_d
    _assert_equal_to_local(results, "llama")
    whole = sum(p.numel() for p in build("llama").parameters())
    # each device holds about half of its stage (a quarter of the model): its shards, the norms whole
    assert all(whole / 5 < result["held"] < whole * 0.3 for result in results)


def test_llama_checkpoint_from_tp2_pp2_loads_into_the_unmodified_model(
    three_d: tuple[list[dict[str, Any]], Path],
) -> None:
    """The checkpoint of the 3D run has the original model's names and loads strictly into it, in one process."""
    import epl

    results, folder = three_d
    saved = epl.read_model_state(folder)
    model = build("llama")
    model.load_state_dict(saved, strict=True)
    _, _, full = train_here("llama")
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, full[name], rtol=TOLERANCE, atol=TOLERANCE, msg=name)


def test_llama_split_2_by_2_stages_by_2_replicas_with_zero_v1_equals_the_local_run() -> None:
    """8 processes: each replica is split(2) x 2 stages; ZeRO v1 chunks every shard over the replicas, whose
    averaged gradient is clipped by its own norm."""
    config = {"auto.auto_parallel": True, "pipeline.num_stages": 2, "zero.level": "v1"}
    results = run_ranks(train, 8, "llama", config, 2, timeout=480)
    assert sorted(result["replica"] for result in results) == [0] * 4 + [1] * 4
    mean = torch.tensor([r["losses"] for r in results if r["stage"] == 1], dtype=torch.float64).mean(0).tolist()
    losses, norms, full = train_here("llama", replicas=2, after_average=True)
    torch.testing.assert_close(mean, losses, rtol=TOLERANCE, atol=TOLERANCE)
    for result in results:
        torch.testing.assert_close(result["norms"], norms[result["replica"]], rtol=TOLERANCE, atol=0)
        for name, value in result["state"].items():
            torch.testing.assert_close(value, full[name], rtol=TOLERANCE, atol=TOLERANCE, msg=name)


INTERLEAVED = {
    "auto.auto_parallel": True,
    "pipeline.num_stages": 4,
    "pipeline.stages_per_rank": 2,
    "pipeline.strategy": "Interleaved1F1B",
}


@pytest.mark.parametrize("split", [1, 2], ids=["2 processes", "split(2) on 4 processes"])
def test_llama_cut_into_4_stages_2_per_rank_interleaved_equals_the_local_run(split: int) -> None:
    """The unmodified Llama cut into 4 stages run by Interleaved1F1B on 2 device groups (stages 0 and 2 on the
    first), each stage whole or tensor parallel: a rank keeps two stages' modules and runs the model's own
    forward once per stage, the other local stage's modules standing in for what it sent."""
    results = run_ranks(train, 2 * split, "llama", INTERLEAVED, split, timeout=300)
    _assert_equal_to_local(results, "llama")
    whole = sum(p.numel() for p in build("llama").parameters())
    if split == 1:
        assert sum(result["held"] for result in results) == whole


def test_llama_built_in_a_replicate_2_scope_cut_into_2_stages_equals_the_local_run() -> None:
    """``with epl.replicate(2)`` around the unmodified Llama, auto-cut into 2 stages on 4 processes: each stage data
    parallel over its 2 devices (each runs half of every micro-batch through the model's own forward), clipping
    after the all-reduce."""
    config = {"auto.auto_parallel": True, "pipeline.num_stages": 2, "communication.clip_after_allreduce": True}
    results = run_ranks(train, 4, "llama", config, 1, None, 2, timeout=300)
    assert [result["stage"] for result in results] == [0, 0, 1, 1]
    _assert_equal_to_local(results, "llama")
    whole = sum(p.numel() for p in build("llama").parameters())
    assert sum(result["held"] for result in results) == 2 * whole  # each stage's 2 devices hold it whole
