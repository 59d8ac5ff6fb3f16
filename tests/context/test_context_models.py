"""``context.degree 2`` on more of transformers' models, float64, against one process (3 AdamW steps, 1e-10): GPT-2
(learned positions read from the global ``position_ids``) and Mistral with a sliding window shorter than the
sequence (the window crosses the devices), with ``Engine.predict`` and ``Engine.evaluate`` after training (the
whole sequence's logits on every device); and the clear errors: a model the check finds would train differently
(RoBERTa reads positions from its token ids; GPT-Neo's attention is its own code), a model built on meta (nothing to
check), a model outside transformers, a sequence that does not divide, Ulysses with heads that do not divide."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.multiprocess

BATCH, SEQUENCE, STEPS, VOCABULARY = 2, 16, 3, 64


def gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCABULARY, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa", use_cache=False)  # fmt: skip
    return GPT2LMHeadModel(config).double()


def mistral(kv_heads: int = 2) -> torch.nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=VOCABULARY, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=kv_heads, sliding_window=5,
                           max_position_embeddings=64, attn_implementation="sdpa", use_cache=False)  # fmt: skip
    return MistralForCausalLM(config).double()


MODELS = {"gpt2": gpt2, "mistral (sliding window 5)": mistral}


def tokens() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCABULARY, (BATCH, SEQUENCE), generator=generator) for _ in range(STEPS)]


def next_token_loss(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs.logits[:, :-1].flatten(0, 1), targets[:, 1:].flatten())


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def locally(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = MODELS[name]()
    optimizer = adamw(model.parameters())
    losses = []
    for batch in tokens():
        optimizer.zero_grad()
        loss = next_token_loss(model(input_ids=batch), batch)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    with torch.no_grad():
        outputs = model(input_ids=tokens()[0])
        losses.append(float(next_token_loss(outputs, tokens()[0])))
    return losses, {**{k: v.clone() for k, v in model.state_dict().items()}, "logits": outputs.logits}


def train(names: list[str]) -> dict[str, Any]:
    import epl

    results = {}
    for name in names:
        epl.init(epl.Config({"context.degree": 2}))
        engine = epl.parallelize(MODELS[name](), optimizer=adamw, loss_fn=next_token_loss)
        losses = [float(engine.step({"input_ids": batch}, batch)) for batch in tokens()]
        losses.append(float(engine.evaluate({"input_ids": tokens()[0]}, tokens()[0])))
        state = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
        state["logits"] = engine.predict({"input_ids": tokens()[0]}).logits
        results[name] = {"losses": losses, "state": state}
    return results


@pytest.fixture(scope="module")
def two_processes() -> list[dict[str, Any]]:
    return run_ranks(train, 2, list(MODELS), timeout=300)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(MODELS))
def test_models_train_as_one_process(two_processes: list[dict[str, Any]], name: str) -> None:
    losses, state = locally(name)
    for result in two_processes:
        torch.testing.assert_close(result[name]["losses"], losses, rtol=1e-10, atol=1e-10)
        for key, value in result[name]["state"].items():
            torch.testing.assert_close(value, state[key], rtol=1e-10, atol=1e-10, msg=key)


def refusals() -> dict[str, str]:
    import epl

    found = {}

    def attempt(name: str, config: dict[str, Any], build: Any, step: Any = None) -> None:
        try:
            epl.init(epl.Config({"context.degree": 2, **config}))
            engine = build()
            if step is not None:
                step(engine)
            found[name] = "no error"
        except epl.errors.EplError as error:
            found[name] = str(error)

    def roberta() -> torch.nn.Module:
        from transformers import RobertaConfig, RobertaForMaskedLM

        torch.manual_seed(0)
        config = RobertaConfig(vocab_size=VOCABULARY, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=4, max_position_embeddings=40)  # fmt: skip
        return RobertaForMaskedLM(config).double()

    def gpt_neo() -> torch.nn.Module:
        from transformers import GPTNeoConfig, GPTNeoForCausalLM

        torch.manual_seed(0)
        config = GPTNeoConfig(vocab_size=VOCABULARY, hidden_size=32, num_layers=2, num_heads=4,
                              max_position_embeddings=32, attention_types=[[["global", "local"], 1]])  # fmt: skip
        return GPTNeoForCausalLM(config).double()

    def on_meta() -> Any:
        with torch.device("meta"):
            model = gpt2()
        return epl.parallelize(model, optimizer=adamw, loss_fn=next_token_loss)

    attempt("positions from the token ids", {}, lambda: epl.parallelize(roberta(), optimizer=adamw))
    attempt("unchecked", {"context.verify": False}, lambda: epl.parallelize(roberta(), optimizer=adamw))
    attempt("attention of its own", {}, lambda: epl.parallelize(gpt_neo(), optimizer=adamw))
    attempt("meta", {}, on_meta)
    attempt("not transformers", {}, lambda: epl.parallelize(torch.nn.Linear(4, 4), optimizer=adamw))
    attempt("length", {}, lambda: epl.parallelize(gpt2(), optimizer=adamw, loss_fn=next_token_loss),
            lambda e: e.step({"input_ids": tokens()[0][:, :10]}, tokens()[0][:, :10]))  # fmt: skip
    attempt("ulysses heads", {"context.mode": "ulysses"},
            lambda: epl.parallelize(mistral(kv_heads=1), optimizer=adamw, loss_fn=next_token_loss),
            lambda e: e.step({"input_ids": tokens()[0]}, tokens()[0]))  # fmt: skip
    return found


@pytest.mark.timeout(300)
def test_what_context_parallelism_cannot_do_is_a_clear_error() -> None:
    found = run_ranks(refusals, 4, timeout=240)[0]
    assert "would train to a different model" in found["positions from the token ids"]
    assert "reads positions other than position_ids" in found["positions from the token ids"]
    assert found["unchecked"] == "no error"  # context.verify False: the user's word, at the user's risk
    assert "no attention layer of GPTNeoForCausalLM called it" in found["attention of its own"]
    assert "meta device" in found["meta"] and "context.verify" in found["meta"]
    assert "is not a transformers model" in found["not transformers"]
    assert "10 tokens do not divide" in found["length"] and "multiple of 4" in found["length"]
    assert "ulysses" in found["ulysses heads"] and "key/value heads" in found["ulysses heads"]
