"""A GPT-2 from ``transformers`` trained end to end: data parallel, auto-partitioned pipeline, ZeRO v1/v2.

The model is ``transformers.GPT2LMHeadModel`` (4 layers, width 64, 4 heads, vocabulary 128,
32 positions, no dropout, random weights: nothing is downloaded), in float64. Each parallel
run on 2 processes is compared with the same model trained in one process by plain PyTorch
(same seed, same token batches, AdamW, next-token cross-entropy): losses and parameters
within 1e-12 (measured: bitwise equal).

Data parallelism and ZeRO train the unmodified ``GPT2LMHeadModel``, with ``lm_head.weight``
tied to ``wte.weight``, and ZeRO v2 on the untied model too.

The pipelines run the unmodified ``GPT2LMHeadModel`` too, whose forward torch.fx cannot trace:
every stage runs the model's own forward (EPL's replayed stages). Cut automatically, the tied
``wte``/``lm_head`` weight is held by both stages and its gradients summed between them each
step, as Megatron does; cut at a split point, the model is untied. Clipping is on.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel  # offline: tests/models/__init__.py

from tests.helpers.distributed import run_ranks
from tests.helpers.reference import assert_rank_matches, train_locally

BATCH, SEQUENCE, STEPS, MICRO = 8, 16, 4, 2
VOCABULARY = 128
#: Relative and absolute tolerance of losses and parameters against the one-process run (float64).
TOLERANCE = 1e-12


def gpt2(*, tied: bool = True, seed: int = 0) -> GPT2LMHeadModel:
    """The tiny GPT-2, float64, every dropout 0, initialised from ``seed``."""
    config = GPT2Config(
        vocab_size=VOCABULARY,
        n_positions=32,
        n_embd=64,
        n_layer=4,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_first_dropout=0.0,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
        tie_word_embeddings=tied,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config).double()


def next_token_loss(outputs: Any, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each position's logits against the next token (HF's ``labels=input_ids`` loss)."""
    logits = outputs.logits  # GPT2LMHeadModel's ModelOutput, on the last stage of a pipeline too
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCABULARY, (BATCH, SEQUENCE), generator=generator) for _ in range(STEPS)]


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def train_here(model: nn.Module, clip: float | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference: one process, each batch's gradient accumulated over 2 halves (the 2 ranks' shares)."""
    pairs = [(t, t) for t in batches()]
    return train_locally(model, adamw(model.parameters()), pairs, MICRO, next_token_loss, max_norm=clip)


def train_with_epl(config: dict[str, Any], model: nn.Module, rows_per_rank: bool) -> dict[str, Any]:
    import epl

    epl.init(epl.Config(config))
    engine = epl.parallelize(model, optimizer=adamw, loss_fn=next_token_loss)
    losses, norms = [], []
    for tokens in batches():
        if rows_per_rank:  # data parallel: this replica's share of the rows
            share = BATCH // engine.num_replicas
            tokens = tokens[share * engine.replica_index : share * (engine.replica_index + 1)]
        losses.append(float(engine.step(tokens, tokens)))
        norms.append(engine.grad_norm)
    state = engine.state_dict(full=True)["model"]  # every rank calls it (ZeRO gathers its chunks)
    return {
        "replica": engine.replica_index,
        "stage": min(engine.context.pipeline.stages, default=None),
        "held": sum(p.numel() for p in engine.parameters()),
        "norms": norms,
        "losses": losses,
        "state": {k: v.detach().clone() for k, v in state.items()},
    }


def every_run() -> dict[str, dict[str, Any]]:
    """On each of 2 ranks: data parallel, ZeRO v1 and v2 on the tied model, v2 on the untied one, the pipelines."""
    runs = {name: train_with_epl(config, gpt2(tied=tied), True) for name, (config, tied) in REPLICATED.items()}
    for name, (config, tied) in PIPELINES.items():
        pipeline = {**config, "pipeline.num_micro_batch": MICRO, "optimizer.max_grad_norm": MAX_NORM}
        runs[name] = train_with_epl(pipeline, gpt2(tied=tied), False)
    return runs


#: The pipeline runs of the unmodified GPT2LMHeadModel on 2 stages: name -> (config, tied embeddings).
PIPELINES = {
    "auto-cut pipeline, tied": ({"auto.auto_parallel": True, "pipeline.num_stages": 2}, True),
    "pipeline at a split point": ({"pipeline.split_points": ["transformer.h.2"]}, False),
}
#: Clipping in the pipeline runs: small enough to clip every step.
MAX_NORM = 0.5


#: The data-parallel runs: name -> (config, tied embeddings).
REPLICATED = {
    "data parallel": ({}, True),
    "zero v1": ({"zero.level": "v1"}, True),
    "zero v2": ({"zero.level": "v2"}, True),
    "zero v2 untied": ({"zero.level": "v2"}, False),
}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, dict[str, Any]]]:
    """Both ranks' results of :func:`every_run` (one launch of 2 processes for the multi-process tests)."""
    return run_ranks(every_run, 2, timeout=240)


@pytest.mark.multiprocess
@pytest.mark.parametrize("run", ["data parallel", "zero v1", "zero v2", "zero v2 untied"])
def test_gpt2_data_parallel_and_zero_equal_the_local_run(ranks: list[dict[str, Any]], run: str) -> None:
    """GPT2LMHeadModel on 2 replicas: plain, ZeRO v1 and v2 with lm_head.weight tied to wte.weight; v2 untied."""
    tied = REPLICATED[run][1]
    model = gpt2(tied=tied)
    assert (model.lm_head.weight is model.transformer.wte.weight) == tied
    expected, full = train_here(model)
    assert sorted(result[run]["replica"] for result in ranks) == [0, 1]
    # each replica returns the loss of its rows; their mean is the whole batch's (the local run's mean over 2 halves)
    mean = torch.tensor([result[run]["losses"] for result in ranks], dtype=torch.float64).mean(0).tolist()
    for result in ranks:
        assert result[run]["state"].keys() == full.keys()
        assert_rank_matches({**result[run], "losses": mean}, expected, full, TOLERANCE)


@pytest.mark.multiprocess
@pytest.mark.parametrize("run", list(PIPELINES))
def test_gpt2_pipelines_equal_the_local_run(ranks: list[dict[str, Any]], run: str) -> None:
    """The unmodified GPT2LMHeadModel as 2 stages, 2 micro-batches, clipping on: cut automatically with the
    embedding and the head tied across the stages (a copy on each, gradients summed between them), or at
    ``transformer.h.2`` untied. Whatever the model returns (its ModelOutput) reaches the loss."""
    tied = PIPELINES[run][1]
    expected, full = train_here(gpt2(tied=tied), clip=MAX_NORM)
    states = [result[run]["state"] for result in sorted(ranks, key=lambda r: r[run]["stage"])]
    assert sorted(k for state in states for k in state) == sorted(full)  # each name on exactly one stage
    assert {k for k in states[0] if not k.startswith("transformer.h.")} == {
        "transformer.wte.weight",
        "transformer.wpe.weight",
    }
    assert {k.split(".")[0] for k in states[1] if not k.startswith("transformer.h.")} == {"transformer", "lm_head"}
    assert {k.split(".")[2] for k in states[0] if k.startswith("transformer.h.")} == {"0", "1"}
    assert {k.split(".")[2] for k in states[1] if k.startswith("transformer.h.")} == {"2", "3"}
    local_norms = _local_norms(tied)
    for result in ranks:
        assert_rank_matches(result[run], expected, full, TOLERANCE)
        torch.testing.assert_close(result[run]["norms"], local_norms, rtol=TOLERANCE, atol=0)
    if tied:  # the stage that holds the head holds a copy of the embedding's weight
        assert torch.equal(states[1]["lm_head.weight"], states[0]["transformer.wte.weight"])


def _local_norms(tied: bool) -> list[float]:
    """The gradient norm before clipping of every step of the local run (the tied weight counted once)."""
    model = gpt2(tied=tied)
    optimizer = adamw(model.parameters())
    norms = []
    for tokens in batches():
        optimizer.zero_grad()
        for part in tokens.chunk(MICRO):
            (next_token_loss(model(part), part) / MICRO).backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
    return norms


def test_auto_partition_cuts_gpt2_between_blocks_with_the_tied_weights_on_both_ends() -> None:
    """The unmodified, tied GPT2LMHeadModel: the cut falls between its blocks; both stages hold the tied weight,
    and the Plan names the devices whose gradients of it are summed."""
    import epl

    epl.init(epl.Config({"auto.auto_parallel": True, "pipeline.num_stages": 2}))
    plan = epl.plan(gpt2(), world_size=4)
    assert [list(tg.modules) for tg in plan.taskgraphs] == [
        ["transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1"],
        ["transformer.h.2", "transformer.h.3", "transformer.ln_f", "lm_head"],
    ]
    assert plan.shared == ((0, 1),)
    assert plan.process_groups()["tied weights"] == [(0, 1, 2, 3)]
