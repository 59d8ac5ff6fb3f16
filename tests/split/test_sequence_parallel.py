"""``split.sequence_parallel`` on transformers models, float64, against one process; the collectives per block:
2 all-gathers and 2 reduce-scatters forward where there were 2 all-reduces; dropout's random states under
pipelines. Sequence length 12 (with 8, a device's 4 tokens would equal the batch, hiding shape mistakes)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.distributed import run_ranks
from tests.helpers.reference import assert_rank_matches, train_locally

pytestmark = pytest.mark.multiprocess
NAMES = ["llama", "mistral", "qwen2", "gpt2"]


def sequence_parallel(names: list[str]) -> dict[str, dict[str, Any]]:
    from tests.models import test_transformers_split as T

    T.SEQUENCE = 12
    return {name: T.train_split(name, {"split.sequence_parallel": True}) for name in names}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, dict[str, Any]]]:
    return run_ranks(sequence_parallel, 2, NAMES, timeout=400)


@pytest.mark.timeout(500)
@pytest.mark.parametrize("name", NAMES)
def test_sequence_parallel_equals_the_local_run(
    ranks: list[dict[str, Any]], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.models import test_transformers_split as T

    monkeypatch.setattr(T, "SEQUENCE", 12)  # in this process only for this test: the other tests use theirs
    model = T.built(name)
    expected, full = train_locally(model, T.adamw(model.parameters()), [(t, t) for t in T.batches()], 1,
                                   T.loss_for(name))  # fmt: skip
    for result in ranks:
        assert_rank_matches(result[name], expected, full, T.TOLERANCES.get(name, T.TOLERANCE))


@pytest.mark.timeout(500)
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_each_all_reduce_of_a_block_becomes_an_all_gather_and_a_reduce_scatter(
    ranks: list[dict[str, Any]], name: str
) -> None:
    """Per block and step: forward 2 all-gathers (into attention and MLP) and 2 reduce-scatters (out of them) where
    there were 2 all-reduces; backward the adjoints (2 reduce-scatters, 2 all-gathers) and, as Megatron-LM, 2
    all-gathers of the saved inputs of the column layers (each device kept its share). Per step: the cut's and the
    final gather's all-gathers; the all-reduces of the embedding, the head's input gradient and the parallel
    cross-entropy (4), and one per whole parameter of a block (Llama's 2 norms; GPT-2's 2 norms' weight and bias
    and 2 row biases)."""
    layers = 2
    whole_per_block = {"llama": 2, "gpt2": 6}[name]
    expected = {"all_gather": 6 * layers + 2, "reduce_scatter": 4 * layers, "all_reduce": 4 + whole_per_block * layers}
    for result in ranks:
        assert result[name]["collectives"] == expected


def three_d() -> list[float]:
    import epl
    from tests.models import test_transformers_split as T

    T.SEQUENCE = 12
    config = {"split.sequence_parallel": True, "pipeline.num_stages": 2, "auto.auto_parallel": True,
              "pipeline.num_micro_batch": 2}  # fmt: skip
    epl.init(epl.Config(config))
    with epl.split(2):
        model = T.built("llama")
    engine = epl.parallelize(model, optimizer=T.adamw, loss_fn=T.loss_for("llama"))
    return [float(engine.step(t, t)) for t in T.batches()]


@pytest.mark.timeout(500)
def test_sequence_parallel_stages_equal_the_local_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """split(2) x 2 stages on 4 processes: the stages send each device's tokens."""
    from tests.models import test_transformers_split as T

    monkeypatch.setattr(T, "SEQUENCE", 12)
    model = T.built("llama")
    expected, _ = train_locally(model, T.adamw(model.parameters()), [(t, t) for t in T.batches()], 1,
                                T.loss_for("llama"))  # fmt: skip
    for losses in run_ranks(three_d, 4, timeout=400):
        assert losses == pytest.approx(expected, rel=1e-10)


def mixtral_refused() -> str:
    import epl
    from tests.models import test_transformers_split as T

    epl.init(epl.Config({"split.sequence_parallel": True}))
    with epl.split(2):
        model = T.built("mixtral")
    try:
        epl.parallelize(model, optimizer=T.adamw, loss_fn=T.loss_for("mixtral"))
    except epl.errors.EplError as error:
        return str(error)
    return ""


@pytest.mark.timeout(300)
def test_a_block_with_more_than_regions_norms_and_dropouts_is_refused() -> None:
    """Mixtral's experts are no column/row pair: its block runs them on each device's tokens, unproven."""
    message = run_ranks(mixtral_refused, 2, timeout=240)[0]
    assert "split.sequence_parallel would run" in message and "split.sequence_parallel to False" in message, message


def gpt2_with_dropout_in_stages() -> dict[str, Any]:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import epl
    from tests.models import test_transformers_split as T

    T.SEQUENCE = 12
    config = {"split.sequence_parallel": True, "pipeline.num_stages": 2, "auto.auto_parallel": True,
              "pipeline.num_micro_batch": 2}  # fmt: skip
    epl.init(epl.Config(config))
    torch.manual_seed(0)
    with epl.split(2):
        model = GPT2LMHeadModel(
            GPT2Config(vocab_size=T.VOCABULARY, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.2,
                       embd_pdrop=0.2, attn_pdrop=0.2, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
        ).double()  # fmt: skip
    engine = epl.parallelize(model, optimizer=T.adamw, loss_fn=T.loss_for("gpt2"))
    losses = [float(engine.step(t, t)) for t in T.batches()]
    whole = {
        name: p.detach().clone()
        for name, p in engine.model.named_parameters()
        if "ln" in name or name.endswith("c_proj.bias") or "wpe" in name
    }
    return {"losses": losses, "whole": whole, "random": torch.get_rng_state()}


@pytest.mark.timeout(500)
def test_dropout_in_stages_keeps_replicated_values_equal_and_the_default_random_state_shared() -> None:
    """GPT-2 with dropout in split(2) x 2 stages: each forward leaves the default random state as it found it
    (its draws aside), so the devices of a shard group keep drawing the same embedding-dropout masks and their
    whole parameters (norms, biases, positions) stay equal."""
    import math

    results = run_ranks(gpt2_with_dropout_in_stages, 4, timeout=400)
    by_stage: dict[frozenset[str], list[dict[str, Any]]] = {}
    for result in results:
        assert all(math.isfinite(loss) for loss in result["losses"])
        by_stage.setdefault(frozenset(result["whole"]), []).append(result)
    assert sorted(len(group) for group in by_stage.values()) == [2, 2]
    for first, second in by_stage.values():
        assert first["random"].equal(second["random"])
        for name, value in first["whole"].items():
            assert value.equal(second["whole"][name]), name


def colocated_refused() -> str:
    import torch
    from torch import nn

    import epl

    epl.init(epl.Config({"split.sequence_parallel": True, "cluster.colocate_split_and_replicate": True}))
    with epl.replicate(2):
        embed = nn.Embedding(16, 8)
    with epl.split(2):
        head = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
    try:
        epl.parallelize(nn.Sequential(embed, head), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    except epl.errors.EplError as error:
        return str(error)
    return ""


@pytest.mark.timeout(300)
def test_sequence_parallelism_beside_a_batch_split_over_the_same_devices_is_refused() -> None:
    message = run_ranks(colocated_refused, 2, timeout=240)[0]
    assert "already split the batch" in message and "colocate_split_and_replicate" in message, message
