"""EPL's split of a whole transformers Llama against DTensor with torchtitan's plan, on 2 processes in the same run.

**The model.** transformers' ``LlamaForCausalLM``, unmodified, random weights from seed 0:
hidden 512, 4 layers, 8 attention heads over 4 key/value heads (grouped-query
attention), SwiGLU MLP of 1376, vocabulary 4096, float32, SDPA attention. Batch 2 x
sequence 128 tokens, next-token cross-entropy computed by the user on ``logits``, AdamW.

**EPL.** ``with epl.split(2): model = LlamaForCausalLM(config)`` and nothing else: the
layout comes from the model's computation (q/k/v and gate/up column-parallel, o and down
row-parallel, the embedding vocabulary-parallel, the head's logits sharded into the
parallel cross-entropy).

**PyTorch.** The same model built again and sharded by
``torch.distributed.tensor.parallel.parallelize_module`` with torchtitan's plan: q/k/v
and gate/up ``ColwiseParallel``, o and down ``RowwiseParallel``, the embedding
``RowwiseParallel`` (vocabulary-parallel), the head ``ColwiseParallel`` with its logits
left sharded (``Shard(-1)``) into ``loss_parallel()``. No sequence parallelism on
either side (EPL has none), so both exchange whole activations by all-reduce.

**Same step first.** Before timing: the same local shards on both sides, the same loss
and the same gradient of every local shard after the first step (float32 tolerance),
the same loss after the second, and parameters within 1e-4 relative after it (AdamW
turns float32 rounding of near-zero gradients into differences of up to its learning
rate on single elements).

**Measured.** Step time in alternating rounds (rank 0's clock; ratio = EPL / DTensor
median; target <= 1.00), and the collectives of one step on each side counted with the
profiler, with their payload bytes. EPL's count is asserted to be Megatron's: 4
all-reduces of the activations per transformer block, plus one for the embedding and one
for the gradient of the head's input. DTensor all-reduces the input gradient of each
column-parallel layer separately (3 for q/k/v, 2 for gate/up, where EPL shares one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from tests.helpers.distributed import run_ranks

from benchmarks.collectives import collectives_of
from benchmarks.harness import Section, mib, ms, record_step_race, short_mode

if TYPE_CHECKING:
    import torch
    from torch import nn

pytestmark = pytest.mark.multiprocess

HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE, VOCABULARY = 512, 4, 8, 4, 1376, 4096
BATCH, SEQUENCE = 2, 128
LR = 1e-3
#: CI (short mode) only catches gross regressions; a full run checks the target with margin for noise.
MAX_RATIO = 2.0 if short_mode() else 1.25
#: Relative difference (Frobenius) of any parameter after two steps.
PARAMETER_TOLERANCE = 1e-4
SECTION = Section(
    "Tensor parallelism of a transformers Llama (split)",
    __file__,
    f"Step time of transformers' `LlamaForCausalLM` (hidden {HIDDEN}, {LAYERS} layers, GQA {HEADS}/{KV_HEADS} "
    f"heads, vocabulary {VOCABULARY}, {BATCH} x {SEQUENCE} tokens, AdamW) under `epl.split(2)` with no rules, "
    "over the same model sharded by DTensor's `parallelize_module` with torchtitan's plan (q/k/v, gate/up "
    "`ColwiseParallel`; o, down `RowwiseParallel`; vocabulary-parallel embedding; head into `loss_parallel`), "
    "2 processes, after checking both take the same step. Target <= 1.00. Collectives and their bytes per step "
    "for both.",
)


def llama() -> nn.Module:
    """The model from seed 0 (the same weights on every rank and on both sides)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCABULARY,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=SEQUENCE,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def next_token_loss(outputs: Any, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each position's logits against the next token, computed on ``logits``."""
    import torch.nn.functional as F

    return F.cross_entropy(outputs.logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def torchtitan_plan() -> dict[str, Any]:
    """torchtitan's tensor-parallel plan for a Llama, in transformers' module names, without sequence parallelism."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    block = "model.layers.*."
    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        **{block + f"self_attn.{name}_proj": ColwiseParallel() for name in ("q", "k", "v")},
        block + "self_attn.o_proj": RowwiseParallel(),
        **{block + f"mlp.{name}_proj": ColwiseParallel() for name in ("gate", "up")},
        block + "mlp.down_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }


def dtensor_step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> Any:
    """One training step of a DTensor-parallel ``model`` as torchtitan runs it: the loss on the vocabulary-sharded
    logits under ``loss_parallel``; a function returning this rank's loss."""
    from torch.distributed.tensor.parallel import loss_parallel

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with loss_parallel():
            loss = next_token_loss(model(tokens), tokens)
            loss.backward()
        optimizer.step()
        return local(loss.detach())

    return step


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor; a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_grad(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``param``'s gradient, laid out as ``param`` (DTensor leaves the vocabulary-parallel
    embedding's gradient replicated: this rank's rows are a slice of it, no communication)."""
    from torch.distributed.tensor import DTensor

    grad = param.grad
    if isinstance(grad, DTensor) and isinstance(param, DTensor):
        grad = grad.redistribute(param.device_mesh, param.placements)
    return local(grad)


def race_against_dtensor(rounds: int, steps: int) -> dict[str, Any]:
    """On this rank: check that EPL and DTensor take the same steps, then time them against each other."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import epl
    from benchmarks.harness import race_steps

    epl.init(epl.Config({}))
    with epl.split(2):
        ours = llama()
    engine = epl.parallelize(ours, optimizer=lambda p: torch.optim.AdamW(p, lr=LR), loss_fn=next_token_loss)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    theirs = parallelize_module(llama(), mesh, torchtitan_plan())
    tokens = torch.randint(0, VOCABULARY, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(1))
    torch_step = dtensor_step(theirs, torch.optim.AdamW(theirs.parameters(), lr=LR), tokens)

    def epl_step() -> torch.Tensor:
        return engine.step(tokens, tokens)

    check_same_steps(dict(engine.model.named_parameters()), dict(theirs.named_parameters()), epl_step, torch_step)
    counted = {"epl": collectives_of(epl_step), "torch": collectives_of(torch_step)}
    activations = f"allreduce {[BATCH, SEQUENCE, HIDDEN]}"
    megatron = 4 * LAYERS + 2  # per block 2 forward, 2 backward; the embedding; the head's input gradient
    assert counted["epl"].counts.get(activations) == megatron, counted["epl"].counts

    return {
        **race_steps("split_llama_vs_dtensor", torch_step, epl_step, rounds=rounds, steps=steps),
        "collectives": {side: count.counts for side, count in counted.items()},
        "bytes": {side: count.bytes for side, count in counted.items()},
    }


def check_same_steps(
    mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], epl_step: Any, torch_step: Any
) -> None:
    """The same shards, then the same loss and shard gradients after one step, the same loss and weights after two."""
    import torch

    assert mine.keys() == theirs.keys(), "EPL and DTensor name the parameters differently"
    for name, param in mine.items():
        assert param.shape == local(theirs[name]).shape, f"EPL and DTensor shard {name} differently"
        assert torch.equal(param, local(theirs[name])), f"EPL's and DTensor's {name} start from different weights"
    torch.testing.assert_close(epl_step(), torch_step(), msg="EPL and DTensor computed different losses")
    for name, param in mine.items():
        torch.testing.assert_close(
            param.grad, local_grad(theirs[name]), rtol=1e-4, atol=1e-6, msg=f"different gradients of {name}"
        )
    torch.testing.assert_close(epl_step(), torch_step(), msg="EPL and DTensor took different first steps")
    for name, param in mine.items():
        difference = float((param - local(theirs[name])).norm() / local(theirs[name]).norm())
        assert difference < PARAMETER_TOLERANCE, f"EPL and DTensor took different steps: {name} differs by {difference}"


def test_split_llama_against_dtensor() -> None:
    """transformers' Llama under ``epl.split(2)`` against DTensor's torchtitan plan: step time and communication."""
    rounds, steps = (3, 1) if short_mode() else (15, 3)
    first, _ = run_ranks(race_against_dtensor, 2, rounds, steps, timeout=900)
    detail = (
        f"Llama hidden {HIDDEN}, {LAYERS} layers, {BATCH} x {SEQUENCE} tokens: DTensor {ms(first['torch_ms'])}, "
        f"EPL {ms(first['epl_ms'])} per step, ratio {first['ratio']:.3f}; collectives per step and rank: "
        f"EPL {first['collectives']['epl']} ({mib(first['bytes']['epl'])}), "
        f"DTensor {first['collectives']['torch']} ({mib(first['bytes']['torch'])})"
    )
    assert first["bytes"]["epl"] < first["bytes"]["torch"], first
    record_step_race(
        "split_llama_vs_dtensor",
        first,
        feature="transformers Llama (`epl.split`, no rules), 2 processes",
        against="DTensor `parallelize_module`, torchtitan plan",
        plot="split Llama vs DTensor",
        section=SECTION,
        detail=detail,
        max_ratio=MAX_RATIO,
        printed=f"{detail} ({first['rounds']} rounds x {first['steps']} steps)",
    )
