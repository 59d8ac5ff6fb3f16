"""A pipeline of an unmodified transformers model: EPL's replayed stages against hand-written PyTorch stages.

**The model.** transformers' ``LlamaForCausalLM``, unmodified: hidden 256, 4 layers, 8 heads
(4 key/value heads), SwiGLU 688, vocabulary 2048, 16 x 64 tokens a step in 4 micro-batches,
float32, SGD, 2 processes.

**EPL.** ``pipeline.split_points = ["model.layers.2"]`` on the model as it is, 1F1B. fx cannot
trace the model, so every stage runs Llama's own ``forward`` (masks, positions and the code
between the blocks included), the other stage's modules answering from what was received.

**PyTorch.** What a ``torch.distributed.pipelining`` user writes for this model: two stage
modules over Llama's own modules (the embedding, the rotary embedding and layers 0-1; the
rotary embedding, layers 2-3, the norm and the head), each computing positions and the
rotary tables itself, run as ``PipelineStage`` s under ``Schedule1F1B`` (``scale_grads=True``).

**Same step first.** Both sides start from the same weights and hold the same weights after
one step (float32 tolerance); then the step time in alternating rounds (rank 0's clock);
ratio = EPL / PyTorch. Target: <= 1.00 (the price of running an unmodified model's forward).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from tests.helpers.distributed import run_ranks

from benchmarks.harness import Section, record_step_race, short_mode, step_times

if TYPE_CHECKING:
    import torch
    from torch import nn

pytestmark = pytest.mark.multiprocess

HIDDEN, LAYERS, VOCABULARY, SEQUENCE, BATCH, MICRO = 256, 4, 2048, 64, 16, 4
LR = 0.01
MAX_RATIO = 2.0 if short_mode() else 1.25
SECTION = Section(
    "Pipelines of unmodified transformers models",
    __file__,
    f"Step time of transformers' LlamaForCausalLM (hidden {HIDDEN}, {LAYERS} layers, vocabulary {VOCABULARY}, "
    f"{BATCH} x {SEQUENCE} tokens in {MICRO} micro-batches, SGD) as 2 pipeline stages on 2 processes, 1F1B: EPL "
    "on the unmodified model (`pipeline.split_points`, every stage runs Llama's own forward) over hand-written "
    "stage modules around the same Llama modules run by `torch.distributed.pipelining` (`Schedule1F1B`), after "
    "checking both take the same step. Target <= 1.00.",
)


def llama() -> nn.Module:
    """The model, from seed 0."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCABULARY,
        hidden_size=HIDDEN,
        intermediate_size=688,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=SEQUENCE,
        tie_word_embeddings=False,
        use_cache=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def loss_of(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of every position's logits against the tokens."""
    from torch import nn

    return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())


def epl_engine() -> Any:
    """The EPL side: the unmodified model cut before layer 2."""
    import torch

    import epl

    epl.init(epl.Config({"pipeline.split_points": ["model.layers.2"], "pipeline.num_micro_batch": MICRO}))
    return epl.parallelize(
        llama(), optimizer=lambda p: torch.optim.SGD(p, lr=LR), loss_fn=lambda out, y: loss_of(out.logits, y)
    )


def stage_modules(model: nn.Module) -> list[nn.Module]:
    """The two stage modules a torch.distributed.pipelining user writes around Llama's own modules."""
    import torch
    from torch import nn

    body = model.model
    half = LAYERS // 2

    def positions(hidden: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        return ids, body.rotary_emb(hidden, ids)

    class First(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens, self.layers = body.embed_tokens, nn.ModuleList(body.layers[:half])

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            hidden = self.embed_tokens(tokens)
            ids, rotary = positions(hidden)
            for layer in self.layers:  # no mask: causal attention (SDPA's is_causal)
                hidden = layer(hidden, position_ids=ids, position_embeddings=rotary)
            return hidden

    class Second(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers, self.norm, self.lm_head = nn.ModuleList(body.layers[half:]), body.norm, model.lm_head

        def forward(self, hidden: torch.Tensor) -> torch.Tensor:
            ids, rotary = positions(hidden)
            for layer in self.layers:
                hidden = layer(hidden, position_ids=ids, position_embeddings=rotary)
            return self.lm_head(self.norm(hidden))

    return [First(), Second()]


class TorchStages:
    """The PyTorch side: this rank's hand-written stage in a torch.distributed.pipelining 1F1B schedule."""

    def __init__(self, tokens: torch.Tensor) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed import pipelining

        self.rank = dist.get_rank()
        model = llama()
        names = {id(p): name for name, p in model.named_parameters()}
        self.module = stage_modules(model)[self.rank]
        self.names = [names[id(p)] for p in self.module.parameters()]
        micro = BATCH // MICRO
        hidden = torch.empty(micro, SEQUENCE, HIDDEN, requires_grad=True)
        inputs = tokens[:micro] if self.rank == 0 else hidden
        outputs = hidden if self.rank == 0 else torch.empty(micro, SEQUENCE, VOCABULARY)
        stage = pipelining.PipelineStage(
            self.module, self.rank, 2, torch.device("cpu"), input_args=inputs, output_args=outputs
        )
        self.schedule = pipelining.Schedule1F1B(stage, MICRO, loss_fn=loss_of, scale_grads=True)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=LR)
        self.tokens = tokens

    def step(self) -> None:
        """One training step: this stage's forwards and backwards, then SGD."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.rank == 0:
            self.schedule.step(self.tokens, return_outputs=False)
        else:
            self.schedule.step(target=self.tokens, losses=[], return_outputs=False)
        self.optimizer.step()

    def parameters(self) -> dict[str, torch.Tensor]:
        """This stage's parameters under the model's names."""
        return dict(zip(self.names, self.module.parameters(), strict=True))


def race(rounds: int, steps: int) -> dict[str, Any]:
    """On this rank: check that EPL and PyTorch take the same step, then time them against each other."""
    import torch

    from benchmarks.harness import race_steps

    tokens = torch.randint(0, VOCABULARY, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(1))
    engine = epl_engine()
    theirs = TorchStages(tokens)
    ours = dict(engine.model.named_parameters())
    assert ours.keys() == theirs.parameters().keys(), "the stages hold different parameters"
    for name, value in theirs.parameters().items():
        assert torch.equal(ours[name], value), f"EPL and PyTorch start from different weights ({name})"
    engine.step({"input_ids": tokens}, tokens)
    theirs.step()
    for name, value in theirs.parameters().items():
        torch.testing.assert_close(ours[name], value, rtol=1e-4, atol=1e-5, msg=f"different steps ({name})")

    return race_steps(
        "pipeline_transformers",
        theirs.step,
        lambda: engine.step({"input_ids": tokens}, tokens),
        rounds=rounds,
        steps=steps,
    )


def test_unmodified_llama_pipeline_against_hand_written_torch_stages() -> None:
    """2 stages on 2 processes: EPL on the unmodified LlamaForCausalLM against hand-written stage modules."""
    rounds, steps = (3, 1) if short_mode() else (15, 3)
    first, _ = run_ranks(race, 2, rounds, steps, timeout=900)
    record_step_race(
        "pipeline_transformers_vs_torch",
        first,
        feature="Pipeline of an unmodified transformers Llama (replayed stages, 1F1B), 2 processes",
        against="hand-written stage modules in `torch.distributed.pipelining`",
        plot="Llama 2 stages vs pipelining",
        section=SECTION,
        detail=f"LlamaForCausalLM, 2 stages, {BATCH} x {SEQUENCE} tokens in {MICRO} micro-batches: {step_times(first)}",
        max_ratio=MAX_RATIO,
    )
