"""Offload v0: weights in host memory, fetched to the device just in time; the same training as without it."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import epl
from epl_memory.offload import CPU_NOTE, HostCopies, offload_parameters, step_with_parameters_fetched
from epl_memory.residency import find_units


def tower() -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)]
    return nn.Sequential(nn.Linear(5, 8), *layers, nn.Linear(8, 2)).double()


def batches(device: str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(2)
    return [
        (torch.randn(6, 5, generator=generator, dtype=torch.float64).to(device),
         torch.randn(6, 2, generator=generator, dtype=torch.float64).to(device))
        for _ in range(3)
    ]  # fmt: skip


def test_host_copies_train_exactly_like_the_model_without_them() -> None:
    plain, offloaded = tower(), tower()
    plain_optimizer = torch.optim.Adam(plain.parameters(), lr=0.01)
    optimizer = torch.optim.Adam(offloaded.parameters(), lr=0.01)
    moving = offload_parameters(offloaded)
    step_with_parameters_fetched(optimizer, moving)
    residency = moving.residency
    assert isinstance(residency, HostCopies)
    for x, y in batches():
        for model, opt in ((plain, plain_optimizer), (offloaded, optimizer)):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        # between steps the device copies are freed; the host copies hold the values
        assert all(p.untyped_storage().nbytes() == 0 for p in offloaded.parameters())
        homes = [residency.home[id(p)] for p in offloaded.parameters()]
        for home, reference in zip(homes, plain.parameters(), strict=True):
            assert torch.equal(home, reference)
    assert residency.host_bytes() == sum(p.numel() * 8 for p in plain.parameters())
    moving.fetch_all()
    state = offloaded.state_dict()
    for key, value in plain.state_dict().items():
        assert torch.equal(state[key], value), key


def test_a_loaded_state_goes_to_the_host_copies() -> None:
    model = tower()
    loaded = {key: torch.full_like(value, 7.0) for key, value in model.state_dict().items()}
    moving = offload_parameters(model)
    model.load_state_dict(loaded)
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    for key, value in model.state_dict().items():
        assert torch.equal(value, loaded[key]), key
    x = torch.randn(2, 5, dtype=torch.float64)
    moving.fetch_all()
    expected = model(x)
    moving.release_all()
    assert torch.equal(model(x), expected)


def test_units_are_the_blocks_of_containers() -> None:
    """Containers are opened (nested ones too); other modules holding parameters are units whole."""
    model = tower()
    units = find_units(model)
    assert units[0] is model
    assert units[1:] == [model[0], model[1][0], model[2][0], model[3][0], model[4]]

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(2, 2)

    blocks = nn.ModuleList([Block(), Block()])
    holder = nn.Module()
    holder.blocks, holder.head = blocks, nn.Linear(2, 2)
    assert find_units(holder) == [holder, blocks[0], blocks[1], holder.head]


def test_offload_on_a_cpu_says_why_nothing_moves(caplog: pytest.LogCaptureFixture) -> None:
    def train(config: dict[str, str]) -> dict[str, torch.Tensor]:
        epl.init(epl.Config(config))
        engine = epl.parallelize(tower(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.MSELoss())
        for x, y in batches():
            engine.step(x, y)
        return engine.model.state_dict()

    with caplog.at_level(logging.WARNING, logger="epl.memory"):
        offloaded = train({"offload.level": "v0"})
    assert CPU_NOTE in caplog.text
    plain = train({})
    for key, value in plain.items():
        assert torch.equal(offloaded[key], value), key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (offload moves weights to host memory)")
def test_offload_keeps_weights_off_the_gpu_between_uses() -> None:
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    before = torch.cuda.memory_allocated()
    moving = offload_parameters(model)
    step_with_parameters_fetched(optimizer, moving)
    weights = sum(p.numel() * p.element_size() for p in reference.parameters())
    assert before - torch.cuda.memory_allocated() >= weights  # the weights left the device
    x = torch.randn(64, 1024, device="cuda")
    torch.cuda.reset_peak_memory_stats()
    model(x).sum().backward()
    torch.cuda.synchronize()
    print(f"offload: weights {weights / 2**20:.1f} MiB, step peak {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB")
    optimizer.step()
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())


def test_a_transformers_model_is_fetched_a_block_at_a_time() -> None:
    """transformers' LlamaModel holds its blocks in ``layers``: it is opened, so ZeRO v2 and offload fetch one
    decoder layer at a time (as FSDP wraps each block), not the whole body at once."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=32)  # fmt: skip
    model = LlamaForCausalLM(config)
    units = find_units(model)
    body = model.model
    assert units == [model, body.embed_tokens, *body.layers, body.norm, model.lm_head]
