"""Activation memory under ``context.degree``: what a forward of transformers' Llama saves for backward on each
device (``saved_tensors_hooks``, storages counted once), a block's worth (3 blocks against 1), against one
process. Each of ``c`` devices keeps at most ``1/c`` + 10% of it, at every length measured, so the longest
sequence that fits a memory cap grows about ``c`` times."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.multiprocess

BATCH, LENGTHS, VOCABULARY = 1, (256, 512), 64


def llama(layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCABULARY, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         attn_implementation="sdpa", use_cache=False)  # fmt: skip
    return LlamaForCausalLM(config)


def saved_per_block(context: int, lengths: tuple[int, ...] = LENGTHS) -> dict[int, float]:
    """Bytes a block saves for backward, by sequence length (one process when ``context`` is 1)."""
    import epl
    from epl.runtime.activations import SavedActivations

    result = {}
    for length in lengths:
        tokens = torch.randint(0, VOCABULARY, (BATCH, length), generator=torch.Generator().manual_seed(0))
        held = []
        for layers in (1, 3):
            model = llama(layers)
            if context > 1:
                epl.init(epl.Config({"context.degree": context}))
                model = epl.parallelize(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1)).model
            meter = SavedActivations(exclude=[*model.parameters(), tokens])
            with meter:
                out = model(input_ids=tokens).logits
            held.append(meter.live)
            out.sum().backward()  # every device runs the backward (the ring's hops are collectives)
        result[length] = (held[1] - held[0]) / 2
    return result


@pytest.mark.timeout(400)
def test_each_context_device_keeps_a_cth_of_the_activations() -> None:
    whole = saved_per_block(1)
    for result in run_ranks(saved_per_block, 2, 2, timeout=300):
        for length in LENGTHS:
            share = result[length] / whole[length]
            print(f"sequence {length}: one process {whole[length]:.0f} B a block, each of 2 devices "
                  f"{result[length]:.0f} B ({share:.3f})")  # fmt: skip
            assert share <= 1 / 2 + 0.10, (length, result[length], whole[length])


CAPPED = (256, 512, 768, 1024, 1280)


@pytest.mark.timeout(400)
def test_the_longest_sequence_under_a_memory_cap_grows_c_times() -> None:
    """The cap: what one process saves a block at 512 tokens. Measured at every length of ``CAPPED``, the longest
    that fits the cap is 512 tokens on one process and 1,024 on each of 2 context devices."""
    whole = saved_per_block(1, CAPPED)
    spread = run_ranks(saved_per_block, 2, 2, CAPPED, timeout=300)
    cap = whole[512]
    longest = {1: max(n for n in CAPPED if whole[n] <= cap)}
    longest[2] = min(max(n for n in CAPPED if result[n] <= cap) for result in spread)
    print(f"cap {cap:.0f} B a block: the longest sequence under it is {longest[1]} tokens on one process, "
          f"{longest[2]} on each of 2 context devices")  # fmt: skip
    assert longest == {1: 512, 2: 1024}
