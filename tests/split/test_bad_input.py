"""Bad input under ``epl.split`` fails on every rank of the replica with EPL's error, as one process fails.

- A token id outside the vocabulary (``vocab`` and -1): in one process ``nn.Embedding`` raises
  ``IndexError``; split, the vocabulary-parallel embedding would embed it as zeros and train on. Now a
  :class:`epl.VocabularyError` (an ``IndexError`` too) naming the id and the vocabulary, on every rank, under
  split(2) (tied and untied embeddings, sequence parallelism) and split(2) x 2 pipeline stages (where the
  stages that hold no embedding check the batch when the step begins).
- A label outside the classes of the split output layer (the parallel cross-entropy): the same; -100
  (``ignore_index``) stays allowed and gives the one-process loss.
- Batches of different sizes on the ranks of a split replica: gloo aborted the process
  (``op.preamble.length <= op.nbytes``) in the forward's first collective; now the batch check's
  :class:`epl.BatchMismatchError` names each rank's sizes, before the forward.

transformers' Llama, tiny, random weights (vocabulary 256). Each launch runs every case on one engine and
returns each rank's messages; a good step after the errors shows the engine still trains.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.distributed import run_ranks

VOCABULARY, BATCH, SEQUENCE = 256, 4, 8


def llama(tied: bool = False) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCABULARY, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, attn_implementation="sdpa", tie_word_embeddings=tied,
    )  # fmt: skip
    return LlamaForCausalLM(config).double()


def next_token_loss(outputs: Any, tokens: torch.Tensor) -> torch.Tensor:
    """The user's loss on ``logits``: under split, the parallel cross-entropy."""
    return F.cross_entropy(outputs.logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCABULARY, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(1))


def bad_batches() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Inputs with an id of ``vocab`` or -1 at [1, 0] (never a target), and targets with one at [2, 5]."""
    good = tokens()
    cases = {}
    for name, value in (("vocab", VOCABULARY), ("-1", -1)):
        inputs = good.clone()
        inputs[1, 0] = value
        cases[f"input id {name}"] = (inputs, good)
        targets = good.clone()
        targets[2, 5] = value
        cases[f"label {name}"] = (good, targets)
    return cases


def ignored_targets() -> torch.Tensor:
    targets = tokens()
    targets[:, :3] = -100
    return targets


def errors_of(engine: Any, cases: dict[str, tuple[Any, Any]]) -> dict[str, tuple[str, str]]:
    """Each case's error (type and message) from ``engine.step``; ("", "") where it trained."""
    import epl

    found = {}
    for case, (inputs, targets) in cases.items():
        try:
            engine.step(inputs, targets)
            found[case] = ("", "")
        except epl.EplError as error:
            found[case] = (type(error).__name__, str(error))
    return found


def split_cases() -> dict[str, Any]:
    """On each of 2 ranks: the bad ids and labels under split(2), untied, tied and sequence parallel; -100 labels;
    then batches of different sizes (rank 1 gets 6 rows where rank 0 gets 4)."""
    import torch.distributed as dist

    import epl

    result: dict[str, Any] = {}
    for layout in ("untied", "tied", "sequence parallel"):
        epl.init(epl.Config({"split.sequence_parallel": layout == "sequence parallel"}))
        with epl.split(2):
            model = llama(tied=layout == "tied")
        engine = epl.parallelize(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=next_token_loss)
        result[layout] = errors_of(engine, bad_batches())
        result[layout + ": ignored labels"] = float(engine.step(tokens(), ignored_targets()))
        result[layout + ": after"] = float(engine.step(tokens(), tokens()))
    epl.init()
    with epl.split(2):
        model = llama()
    engine = epl.parallelize(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=next_token_loss)
    rows = BATCH + 2 * dist.get_rank()
    ids = torch.randint(0, VOCABULARY, (rows, SEQUENCE), generator=torch.Generator().manual_seed(2))
    result["sizes"] = errors_of(engine, {"sizes": (ids, ids)})["sizes"]
    # whole embeddings: data parallelism, and a 2-stage pipeline (the second stage never sees the ids)
    for layout, config in (("data parallel", {}), ("pipeline", {"pipeline.num_stages": 2, "auto.auto_parallel": True,
                           "pipeline.num_micro_batch": 2, "communication.timeout": 60})):  # fmt: skip
        epl.init(epl.Config(config))
        engine = epl.parallelize(llama(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=next_token_loss)
        result[layout] = errors_of(engine, bad_batches())
        result[layout + ": after"] = float(engine.step(tokens(), tokens()))
    return result


def locally(tied: bool = False) -> tuple[float, float]:
    """The same script in one process: the loss of the -100 labels' step, then of the next one (after the bad
    steps, which change nothing there either: each raises)."""
    model = llama(tied)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for inputs, targets in bad_batches().values():
        with pytest.raises(IndexError):
            next_token_loss(model(inputs), targets)
    losses = []
    for inputs, targets in ((tokens(), ignored_targets()), (tokens(), tokens())):
        optimizer.zero_grad()
        loss = next_token_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses[0], losses[1]


def assert_named(errors: dict[str, tuple[str, str]]) -> None:
    """Each bad case raised VocabularyError naming its id and the vocabulary."""
    for case, (kind, message) in errors.items():
        assert kind == "VocabularyError", (case, kind, message)
        value = "256" if case.endswith("vocab") else "-1"
        assert "0 .. 255" in message and "IndexError" in message, message
        if case.startswith("label"):
            assert f"hold {value}, outside the {VOCABULARY} classes of the" in message, (case, message)
            assert "-100 (ignore_index)" in message, message
        else:
            assert f"hold {value}, outside the vocabulary of {VOCABULARY}" in message, (case, message)
            assert "config.vocab_size" in message, message


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_ids_and_labels_outside_the_vocabulary_and_batches_of_different_sizes_fail_on_every_rank() -> None:
    local = {tied: locally(tied) for tied in (False, True)}
    with torch.no_grad():
        first = float(next_token_loss(llama()(tokens()), tokens()))
    results = run_ranks(split_cases, 2, timeout=280)
    for rank, result in enumerate(results):
        for layout in ("untied", "tied", "sequence parallel"):
            ignored, after = local[layout == "tied"]
            assert_named(result[layout])
            assert "'model.embed_tokens'" in result[layout]["input id vocab"][1]
            assert result[layout + ": ignored labels"] == pytest.approx(ignored, rel=1e-9), (rank, layout)
            assert result[layout + ": after"] == pytest.approx(after, rel=1e-9), (rank, layout)
        for layout in ("data parallel", "pipeline"):  # every rank names the id, as under split; nothing trained
            assert_named(result[layout])
            assert result[layout + ": after"] == pytest.approx(first, rel=1e-9), (rank, layout)
        kind, message = result["sizes"]
        assert kind == "BatchMismatchError", message
        assert "were given batches of different sizes at step 1" in message, message
        assert "rank 0: [4, 8], [4, 8]; rank 1: [6, 8], [6, 8]" in message and "ranks [1] differ" in message
    assert results[0] == results[1]


def pipeline_cases() -> dict[str, Any]:
    """On each of 4 ranks, split(2) x 2 pipeline stages: the bad ids and labels (targets, and a dict batch's
    ``labels`` for the model's own loss), a bad id given to evaluate and predict, -100 labels, then a good step."""
    import epl

    config = {"pipeline.num_stages": 2, "auto.auto_parallel": True, "pipeline.num_micro_batch": 2,
              "communication.timeout": 60}  # fmt: skip
    epl.init(epl.Config(config))
    with epl.split(2):
        model = llama()
    engine = epl.parallelize(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=next_token_loss)
    result: dict[str, Any] = {"errors": errors_of(engine, bad_batches())}
    inputs, targets = bad_batches()["input id vocab"]
    for call in (lambda: engine.evaluate(inputs, targets), lambda: engine.predict(inputs)):
        try:
            call()
            result.setdefault("evaluate and predict", []).append("")
        except epl.VocabularyError as error:
            result.setdefault("evaluate and predict", []).append(str(error))
    result["ignored labels"] = float(engine.step(tokens(), ignored_targets()))
    result["after"] = float(engine.step(tokens(), tokens()))
    epl.init(epl.Config(config))
    with epl.split(2):
        model = llama()
    engine = epl.parallelize(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    labels = tokens()
    labels[0, 3] = VOCABULARY
    result["own loss"] = errors_of(engine, {"label vocab": ({"input_ids": tokens(), "labels": labels}, None)})
    return result


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_every_stage_of_a_split_pipeline_fails_on_an_id_outside_the_vocabulary() -> None:
    """The stages that hold neither the embedding nor the head check the batch too: none waits for another."""
    ignored, after = locally()
    results = run_ranks(pipeline_cases, 4, timeout=280)
    for result in results:
        assert_named(result["errors"])
        assert "The token ids of the batch (its first integer tensor)" in result["errors"]["input id vocab"][1]
        assert all("hold 256, outside the vocabulary of 256" in m for m in result["evaluate and predict"]), result
        assert result["ignored labels"] == pytest.approx(ignored, rel=1e-9)
        assert result["after"] == pytest.approx(after, rel=1e-9)
        kind, message = result["own loss"]["label vocab"]
        assert kind == "VocabularyError" and "The labels of the batch (the inputs' 'labels') hold 256" in message


def test_the_check_names_the_largest_id_and_allows_ignore_index() -> None:
    import epl
    from epl.sharding.vocabulary import check_in_vocabulary

    check_in_vocabulary(torch.tensor([0, 5, -100]), 6, "ids", ignore_index=-100)
    check_in_vocabulary(torch.empty(0, dtype=torch.long), 6, "ids")
    with pytest.raises(epl.VocabularyError, match=r"ids hold 9, outside the vocabulary of 6 .* 2 of 4 elements"):
        check_in_vocabulary(torch.tensor([[0, -3], [9, 1]]), 6, "ids")
    with pytest.raises(IndexError, match=r"hold -100, outside the vocabulary of 6 \(0 \.\. 5\)"):
        check_in_vocabulary(torch.tensor([-100]), 6, "ids")


def test_fingerprints_have_one_length_whatever_the_batch() -> None:
    """The all-gather of fingerprints never mismatches: every batch gives the same count of numbers."""
    from epl.runtime.batch_check import FINGERPRINT, fingerprint

    batches = [
        (torch.ones(4, 8), None),
        ({"a": torch.ones(2), "b": torch.ones(3, 4, 5, 6, 7), "c": torch.ones(1)},),
        (),
    ]
    assert {fingerprint(batch).numel() for batch in batches} == {FINGERPRINT}
    nan = torch.full((3,), float("nan"))
    assert torch.equal(fingerprint((nan,)).view(torch.int64), fingerprint((nan.clone(),)).view(torch.int64))
