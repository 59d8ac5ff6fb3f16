"""Selective activation checkpointing on transformers' Llama: EPL's ``selective`` against no checkpointing, against
whole-block recomputation (EPL's ``auto``) and against torch's own selective checkpointing written by hand.

One process, one thread, float32. Four copies of the same model (same seed): plain, EPL ``selective``, EPL
``auto``, and a plain loop whose decoder layers run under ``torch.utils.checkpoint`` with
``create_selective_checkpoint_contexts`` and torchtitan's policy (its ``_save_list`` of products and attention
kernels, with the CPU's flash kernel: torchtitan runs on CUDA). Before timing, all four take the same training
step (losses equal). Measured: the bytes a forward leaves allocated for backward (the CPU allocator's running total
under the profiler), and the step time of each pair in alternating rounds.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import epl
from benchmarks.harness import Ratio, ResultRow, Section, compare, mib, ms, record, short_mode
from epl_memory.measure import kept_allocated_bytes

HIDDEN, LAYERS, HEADS = (128, 2, 4) if short_mode() else (512, 4, 8)
BATCH, SEQUENCE, VOCABULARY = (2, 64, 256) if short_mode() else (2, 256, 1024)
SECTION = Section(
    "Selective activation checkpointing",
    __file__,
    f'EPL `gradient_checkpoint.type = "selective"` on transformers\' Llama (hidden {HIDDEN}, {LAYERS} layers, '
    f"{HEADS} heads, batch {BATCH} x {SEQUENCE} tokens, float32), one thread: each decoder layer keeps its matrix "
    "products' and SDPA's outputs and recomputes the norms, rotary, SiLU and elementwise work. Against no "
    "checkpointing, against whole-layer recomputation (EPL's `auto`) and against torch's own selective "
    "checkpointing written by hand (torchtitan's per-operation policy). *Activations*: bytes a forward leaves "
    "allocated for backward.",
)
#: torchtitan's ``_save_list`` (torchtitan/distributed/activation_checkpoint.py), with the CPU's flash kernel.
TORCHTITAN_SAVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops.aten.max.default,
}


def torchtitan_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in TORCHTITAN_SAVE else CheckpointPolicy.PREFER_RECOMPUTE


class SelectiveByHand(nn.Module):
    """A decoder layer run under torch's selective checkpointing, as torchtitan wraps its blocks."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        context = functools.partial(create_selective_checkpoint_contexts, torchtitan_policy)
        return torch.utils.checkpoint.checkpoint(self.layer, *args, use_reentrant=False, context_fn=context, **kwargs)


def build(by_hand: bool = False) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=HIDDEN * 8 // 3, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=HEADS // 2, vocab_size=VOCABULARY, max_position_embeddings=SEQUENCE, use_cache=False,
        attn_implementation="sdpa",
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    if by_hand:
        for index, layer in enumerate(model.model.layers):
            model.model.layers[index] = SelectiveByHand(layer)
    return model


def loss_of(outputs: Any, tokens: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(outputs.logits.flatten(0, 1), tokens.flatten())


def plain_step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> torch.Tensor:
    optimizer.zero_grad()
    loss = loss_of(model(input_ids=tokens), tokens)
    loss.backward()
    optimizer.step()
    return loss.detach()


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01)


def engine_of(kind: str) -> Any:
    epl.init(epl.Config({"gradient_checkpoint.type": kind}))
    return epl.parallelize(build(), optimizer=sgd, loss_fn=loss_of)


def kept_after_forward(model: nn.Module, tokens: torch.Tensor) -> int:
    """Bytes the forward leaves allocated for backward (the logits included)."""
    kept: list[Any] = []
    return kept_allocated_bytes(lambda: kept.append(model(input_ids=tokens).logits))


def test_selective_against_none_full_and_torch() -> None:
    torch.set_num_threads(1)
    tokens = torch.randint(0, VOCABULARY, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(1))
    plain, by_hand = build(), build(by_hand=True)
    plain_opt, hand_opt = sgd(plain.parameters()), sgd(by_hand.parameters())
    full = engine_of("auto")  # each block recomputed from its input
    selective = engine_of("selective")

    losses = [
        float(plain_step(plain, plain_opt, tokens)),
        float(plain_step(by_hand, hand_opt, tokens)),
        float(full.step(tokens, tokens)),
        float(selective.step(tokens, tokens)),
    ]
    assert max(losses) - min(losses) < 1e-5, losses

    kept = {
        "none": kept_after_forward(plain, tokens),
        "torch": kept_after_forward(by_hand, tokens),
        "full": kept_after_forward(full.model, tokens),
        "selective": kept_after_forward(selective.model, tokens),
    }
    rounds, calls = (2, 1) if short_mode() else (7, 1)
    timing = {"rounds": rounds, "calls_per_round": calls, "warmup": 1}
    against_none = compare(
        "selective_vs_none", lambda: plain_step(plain, plain_opt, tokens), lambda: selective.step(tokens, tokens),
        **timing,
    )  # fmt: skip
    against_full = compare(
        "selective_vs_full", lambda: full.step(tokens, tokens), lambda: selective.step(tokens, tokens), **timing
    )
    against_torch = compare(
        "selective_vs_torch", lambda: plain_step(by_hand, hand_opt, tokens), lambda: selective.step(tokens, tokens),
        **timing,
    )  # fmt: skip
    feature = f"Selective checkpointing, Llama {HIDDEN} x {LAYERS} layers"
    rows = [
        ResultRow(
            feature, "no checkpointing", time=(Ratio(against_none.ratio),),
            memory=(Ratio(kept["selective"] / kept["none"], "activations"),), plot="selective vs none",
        ),
        ResultRow(
            feature, 'whole-layer recomputation (EPL `auto`)', time=(Ratio(against_full.ratio),),
            memory=(Ratio(kept["selective"] / kept["full"], "activations"),), plot="selective vs full recomputation",
        ),
        ResultRow(
            feature, "torch selective checkpointing by hand (torchtitan's policy)",
            time=(Ratio(against_torch.ratio),),
            memory=(Ratio(kept["selective"] / kept["torch"], "activations"),), plot="selective vs torch SAC",
        ),
    ]  # fmt: skip
    details = [
        f"step time: selective {ms(against_none.epl_s * 1e3)}, none {ms(against_none.baseline_s * 1e3)}, "
        f"full {ms(against_full.baseline_s * 1e3)}, torch by hand {ms(against_torch.baseline_s * 1e3)}",
        "activations kept after forward: " + ", ".join(f"{name} {mib(value)}" for name, value in kept.items()),
    ]
    record("selective_checkpointing", rows, section=SECTION, details=details)
    print(
        f"\nselective checkpointing: kept {', '.join(f'{k} {v / 2**20:.2f} MiB' for k, v in kept.items())}; "
        f"time selective/none {against_none.ratio:.2f}, selective/full {against_full.ratio:.2f}, "
        f"selective/torch {against_torch.ratio:.2f}"
    )
    assert kept["full"] < kept["selective"] < kept["none"], kept
    assert kept["selective"] <= 1.05 * kept["torch"], kept  # the same policy, and EPL keeps nothing more
    if not short_mode():  # nothing recomputes a product: no slower than whole-layer recomputation
        assert against_full.ratio <= 1.05, against_full.line()
        assert against_torch.ratio <= 1.10, against_torch.line()
