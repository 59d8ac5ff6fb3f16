"""One training mode of a transformers Llama, timed the same way in a plain PyTorch loop and under EPL.

``benchmarks/test_gpu_mfu.py`` runs it on a GPU (the MFU suite); ``tests/benchmarks/test_mfu_modes.py`` runs each
mode on a tiny Llama on the CPU, so a GPU loan never finds it broken. The modes are torchtitan's:

- ``eager``: AMP bf16 (float32 weights, bf16 products), fused AdamW;
- ``compiled``: each decoder block ``torch.compile``d (``compile.enabled`` for EPL);
- ``float8``: compiled, with torchao's float8 linears (tensorwise scales; the first and last blocks and the head
  stay in bf16 on both sides, EPL's default exclusions);
- ``linear_ce``: compiled, with the loss computed from the last hidden states and the head's weight by a linear
  cross-entropy over the vocabulary in chunks of tokens (``torch.nn.functional.linear_cross_entropy`` where torch
  has its chunked path, otherwise one chunk at a time under ``torch.utils.checkpoint``): the float32 logits of the
  whole batch never exist.

Each side runs alone (two copies of a large model do not fit one device): built from the same seed, warmed up,
then timed over ``steps`` steps (each ending in a device synchronisation); the first losses must agree.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

MODES = ("eager", "compiled", "float8", "linear_ce")

#: Llama 3.2 3B's shape: the largest Llama of a published family that trains on one H200 with AdamW at 8K tokens
#: without recomputation (about 51 GB of weights, gradients and Adam states in float32, and the activations).
LLAMA_3B = {"hidden": 3072, "layers": 28, "heads": 24, "kv_heads": 8, "intermediate": 8192, "vocabulary": 128256}
#: Tokens per chunk of the linear cross-entropy.
CHUNK = 4096


@dataclass(frozen=True)
class ModeResult:
    """Seconds per step (median), the first loss and the peak device bytes of one side in one mode."""

    seconds: float
    first_loss: float
    peak_bytes: int | None


def llama(shape: dict[str, int], device: str, sequence: int) -> nn.Module:
    """transformers' LlamaForCausalLM of ``shape``, random weights from seed 0, on ``device``, SDPA attention."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=shape["hidden"], num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], intermediate_size=shape["intermediate"],
        vocab_size=shape["vocabulary"], max_position_embeddings=sequence, attn_implementation="sdpa", use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.LlamaForCausalLM(config)


def model_flops_per_token(shape: dict[str, int], parameters: int, sequence: int) -> float:
    """PaLM's 6·N + 12·L·h·s, N the weights of the blocks and the head (the input embedding not counted)."""
    weights = parameters - shape["vocabulary"] * shape["hidden"]
    return 6 * weights + 12 * shape["layers"] * shape["hidden"] * sequence


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``labels``, never holding more than :data:`CHUNK`
    tokens' logits: torch's chunked ``linear_cross_entropy`` where it has one, else each chunk's logits made under
    ``torch.utils.checkpoint`` (made again in the backward, not kept)."""
    hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    options = getattr(torch.nn, "LinearCrossEntropyOptions", None)
    if options is not None and hasattr(F, "linear_cross_entropy"):
        return F.linear_cross_entropy(hidden, weight, labels, options=options(batch_chunk_size=CHUNK))
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], CHUNK):
        piece = slice(start, start + CHUNK)
        total = total + torch.utils.checkpoint.checkpoint(
            _chunk_loss, hidden[piece], weight, labels[piece], use_reentrant=False
        )
    return total / labels.numel()


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction="sum")


class LinearCrossEntropyLM(nn.Module):
    """A causal LM whose loss is :func:`chunked_linear_cross_entropy` of its last hidden states and its head's
    weight (the next token of each position), as transformers' own loss is of the logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        from transformers.modeling_outputs import CausalLMOutput

        hidden = self.model.model(input_ids=input_ids).last_hidden_state[:, :-1]
        weight = self.model.lm_head.weight
        if torch.is_autocast_enabled(hidden.device.type):
            dtype = torch.get_autocast_dtype(hidden.device.type)
            hidden, weight = hidden.to(dtype), weight.to(dtype)
        return CausalLMOutput(loss=chunked_linear_cross_entropy(hidden, weight, labels[:, 1:]))


def float8_filter(layers: int) -> Callable[[nn.Module, str], bool]:
    """torchao's module filter of EPL's default float8 exclusions: the first and last blocks and the head."""
    kept_whole = (".layers.0.", f".layers.{layers - 1}.", "lm_head")

    def convert(module: nn.Module, name: str) -> bool:
        return isinstance(module, nn.Linear) and not any(part in f".{name}" for part in kept_whole)

    return convert


def compile_blocks(model: nn.Module, backend: str) -> None:
    """Each decoder block replaced by ``torch.compile(block)``, as torchtitan compiles them."""
    layers = model.model.layers
    for index, block in enumerate(layers):
        layers.register_module(str(index), torch.compile(block, backend=backend))


def plain_model(mode: str, shape: dict[str, int], device: str, sequence: int, backend: str) -> nn.Module:
    """The plain loop's model in ``mode``."""
    model = llama(shape, device, sequence)
    if mode == "float8":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name("tensorwise")
        convert_to_float8_training(model, config=config, module_filter_fn=float8_filter(shape["layers"]))
    if mode != "eager":
        compile_blocks(model, backend)
    return LinearCrossEntropyLM(model) if mode == "linear_ce" else model


def epl_config(mode: str, backend: str) -> dict[str, Any]:
    """EPL's config of ``mode``."""
    config: dict[str, Any] = {"amp.level": "O1", "amp.dtype": "bfloat16"}
    if mode != "eager":
        config.update({"compile.enabled": True, "compile.backend": backend})
    if mode == "float8":
        config.update({"float8.enabled": True, "float8.recipe": "tensorwise"})
    return config


def run_mode(
    mode: str,
    side: str,
    *,
    shape: dict[str, int],
    batch: int,
    sequence: int,
    device: str,
    steps: int,
    warmup: int = 2,
    backend: str = "inductor",
) -> ModeResult:
    """One side (``plain`` or ``epl``) of ``mode``: ``warmup`` steps, then ``steps`` timed ones; the device emptied
    after (the next side has it to itself)."""
    import epl

    try:
        return _measure(_stepper(mode, side, shape, batch, sequence, device, backend), device, steps, warmup)
    finally:
        if side == "epl" and epl.Env._current is not None:
            epl.Env._current.close()
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def _stepper(
    mode: str, side: str, shape: dict[str, int], batch: int, sequence: int, device: str, backend: str
) -> Callable[[], torch.Tensor]:
    """One training step of ``side`` in ``mode`` on a fixed batch."""
    import epl

    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, shape["vocabulary"], (batch, sequence), generator=generator).to(device)
    inputs = {"input_ids": tokens, "labels": tokens}
    fused = device.startswith("cuda")
    if side == "epl":
        epl.init(epl.Config(epl_config(mode, backend)))
        base = llama(shape, device, sequence)
        model = LinearCrossEntropyLM(base) if mode == "linear_ce" else base
        engine = epl.parallelize(model, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-5, fused=fused))
        return lambda: engine.step(inputs)
    plain = plain_model(mode, shape, device, sequence, backend)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-5, fused=fused)

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            loss = plain(**inputs).loss
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def _measure(step: Callable[[], torch.Tensor], device: str, steps: int, warmup: int) -> ModeResult:
    """The first loss, then the median seconds of ``steps`` steps after ``warmup`` (the first included) and the
    peak device bytes over them (on CUDA)."""
    cuda = device.startswith("cuda")
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    first = float(step())
    for _ in range(warmup - 1):
        step()
    synchronize()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        synchronize()
        times.append(time.perf_counter() - start)
    return ModeResult(statistics.median(times), first, torch.cuda.max_memory_allocated() if cuda else None)
