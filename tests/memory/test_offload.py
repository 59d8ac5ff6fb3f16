"""Offload v0 on FSDP2: weights, gradients and optimizer state in host memory; the same training as without it.

Several processes and a lent GPU take the real path; on these CPUs one process has nothing to move (its host memory
is its device's), so the one-process test forces the path in a process of its own, where it runs on the CPU with
the same arithmetic and bookkeeping. Layouts with offload (with and without ZeRO, under split) are in
``test_zero_layouts.py``.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import epl
from epl_memory.blocks import find_units
from epl_memory.offload import CPU_NOTE
from tests.helpers.distributed import run_ranks


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


def plain_training(device: str = "cpu") -> tuple[list[float], dict[str, torch.Tensor]]:
    model = tower().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses = []
    for x, y in batches(device):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, {key: value.cpu() for key, value in model.state_dict().items()}


def take_the_fsdp2_path() -> None:
    """In this rank's process: offload goes through FSDP2 on a CPU too, where one process would change nothing."""
    import epl_memory.offload

    epl_memory.offload.offloads = lambda context: bool(context.config["offload.level"])


def offloaded_training(folder: str, force: bool = True) -> dict[str, Any]:
    """One process, offload v0 (forced onto the FSDP2 path on a CPU), three steps, a save and a load."""
    if force:
        take_the_fsdp2_path()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("epl.memory").addHandler(handler)
    epl.init(epl.Config({"offload.level": "v0"}))
    engine = epl.parallelize(
        tower(), optimizer=lambda p: torch.optim.AdamW(p, lr=0.01), loss_fn=nn.MSELoss()
    )  # fmt: skip
    homes = {name: str(p.to_local().device) for name, p in engine.model.named_parameters()}
    losses = [float(engine.step(x, y)) for x, y in batches(device)]
    states = [str(value.device) for group in engine.optimizer.state.values() for value in group.values()]
    engine.save(folder)
    state = {key: value.clone() for key, value in engine.state_dict(full=True)["model"].items()}
    engine.step(*batches(device)[0])  # moves away from the saved state
    engine.load(folder)
    with torch.device("meta"):  # a model built on meta gets its values in host memory, never whole on the device
        meta = tower()
    built = epl.parallelize(meta, optimizer=lambda p: torch.optim.AdamW(p, lr=0.01), loss_fn=nn.MSELoss())
    built.step(*batches(device)[0])
    return {
        "said": said,
        "meta homes": {str(p.to_local().device) for p in built.model.parameters()},
        "losses": losses,
        "state": state,
        "loaded": engine.state_dict(full=True)["model"],
        "homes": homes,
        "optimizer state": states,
        "readable": [float(p.sum()) for p in engine.parameters()],
    }


def offloaded_micro_batches() -> dict[str, Any]:
    """One process, offload v0 (forced onto the FSDP2 path), three micro-batches a step: the losses, the weights, and
    where the gradients FSDP2 wrote were summed."""
    import threading

    from epl_memory.host_gradients import HostGradientSums

    take_the_fsdp2_path()
    sums = []
    add = HostGradientSums._sum

    def counted(self: HostGradientSums) -> None:
        worker = threading.current_thread().name.startswith("epl-host-gradients")  # not autograd's nor the main
        sums.append((worker, sum(len(taken) > 1 for _, taken in self._taken.values())))
        add(self)

    HostGradientSums._sum = counted  # type: ignore[method-assign]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    epl.init(epl.Config({"offload.level": "v0", "pipeline.num_micro_batch": 3}))
    engine = epl.parallelize(tower(), optimizer=lambda p: torch.optim.AdamW(p, lr=0.01), loss_fn=nn.MSELoss())
    losses = [float(engine.step(x, y)) for x, y in batches(device)]
    return {"losses": losses, "state": engine.state_dict(full=True)["model"], "sums": sums}


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_micro_batches_sum_their_gradients_off_the_backward_as_one_batch() -> None:
    """FSDP2 adds a second micro-batch's gradient on the CPU inside the backward, stalling the device; EPL takes the
    earlier ones away first and sums them on a worker meanwhile (epl_memory.host_gradients). The step equals one
    whole batch's."""
    (result,) = run_ranks(offloaded_micro_batches, 1, timeout=150)
    losses, state = plain_training()
    assert result["losses"] == pytest.approx(losses, rel=1e-12, abs=1e-12)
    for key, value in state.items():
        torch.testing.assert_close(result["state"][key], value, rtol=1e-12, atol=1e-12, msg=key)
    # each step: the first two micro-batches' gradients on EPL's worker, the last in the backward's own thread before
    # the update; every one of the tower's 10 tensors summed each time after the first
    assert result["sums"] == [(True, 0), (True, 10), (False, 10)] * 3, result["sums"]


def test_host_sums_hide_no_gradient_and_forget_a_step_that_raised() -> None:
    """The bookkeeping alone, on plain tensors: gradients are whole after a step's last backward and after any
    backward the runner did not announce, and a step cut off after its first micro-batch leaves nothing behind."""
    from epl.sharding.data_shards import micro_batch_listeners
    from epl_memory.host_gradients import HostGradientSums

    model, reference = tower(), tower()
    sums = HostGradientSums(list(model.parameters()), torch.device("cpu"))
    sums.install(model, [model[1], model[2], model[3]])
    (x, y), (x2, y2), _ = batches()

    def backward(net: nn.Module, rows: slice, inputs: torch.Tensor = x, targets: torch.Tensor = y) -> None:
        nn.functional.mse_loss(net(inputs[rows]), targets[rows]).backward()

    for index, rows in enumerate((slice(0, 2), slice(2, 4), slice(4, 6))):  # a step of three micro-batches
        sums._micro_batch(index, 3)
        backward(model, rows)
        backward(reference, rows)
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-14, atol=1e-14)
    backward(model, slice(0, 6))  # a backward nobody announced adds to the gradients, as autograd does
    backward(reference, slice(0, 6))
    assert all(p.grad is not None for p in model.parameters())
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-14, atol=1e-14)
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    sums._micro_batch(0, 3)  # a step that raises after its first micro-batch's backward
    backward(model, slice(0, 2), x2, y2)
    for index, rows in enumerate((slice(0, 2), slice(2, 4), slice(4, 6))):  # the next step forgets it
        sums._micro_batch(index, 3)
        backward(model, rows)
        backward(reference, rows)
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-14, atol=1e-14)
    assert sums._worker is not None
    copied = copy.deepcopy(model)  # an EMA's start: the copy has its own sums, and no worker
    copied_sums = micro_batch_listeners(copied)[0].__self__  # type: ignore[attr-defined]
    assert copied_sums is not sums and copied_sums._worker is None
    assert all(a is b for a, b in zip(copied_sums.params, copied.parameters(), strict=True))


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_offload_in_one_process_trains_as_without_it_and_saves(tmp_path: Path) -> None:
    (result,) = run_ranks(offloaded_training, 1, str(tmp_path / "checkpoint"), timeout=150)
    losses, state = plain_training()
    assert set(result["homes"].values()) == result["meta homes"] == {"cpu"}  # every weight's home is host memory
    assert set(result["optimizer state"]) == {"cpu"}  # and so is the optimizer's state: it steps on the CPU
    assert result["losses"] == pytest.approx(losses, rel=1e-12, abs=1e-12)
    for key, value in state.items():
        torch.testing.assert_close(result["state"][key], value, rtol=1e-12, atol=1e-12, msg=key)
        torch.testing.assert_close(result["loaded"][key], value, rtol=1e-12, atol=1e-12, msg=key)
    assert len(result["readable"]) == len(state)
    assert any("torch.optim.AdamW(..., fused=True)" in line for line in result["said"]), result["said"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="about a process without an accelerator")
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


def test_a_transformers_model_is_fetched_a_block_at_a_time() -> None:
    """transformers' LlamaModel holds its blocks in ``layers``: it is opened, so ZeRO and offload gather one
    decoder layer at a time (as FSDP wraps each block), not the whole body at once."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=32)  # fmt: skip
    model = LlamaForCausalLM(config)
    units = find_units(model)
    body = model.model
    assert units == [model, body.embed_tokens, *body.layers, body.norm, model.lm_head]


def on_one_gpu(overlap: bool = False) -> dict[str, Any]:
    """offload v0 on one GPU: what the device holds after parallelize and at a step's peak, against the weights
    (``overlap``: with ``offload.overlap_step``)."""
    width, depth = 1024, 8
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)]).cuda()
    reference = copy.deepcopy(model)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    epl.init(epl.Config({"offload.level": "v0", "offload.overlap_step": overlap}))
    before = torch.cuda.memory_allocated()
    engine = epl.parallelize(model, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), loss_fn=nn.MSELoss())
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    x = torch.randn(64, width, device="cuda")
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for _ in range(3):
        engine.step(x, x)
        reference_optimizer.zero_grad()
        nn.functional.mse_loss(reference(x), x).backward()
        reference_optimizer.step()
    with engine.full_parameters():
        gap = max(float((p.detach().cpu() - r.detach().cpu()).abs().max()) for p, r in
                  zip(engine.model.parameters(), reference.parameters(), strict=True))  # fmt: skip
    return {"weights": weights, "held": held, "gap": gap}


@pytest.mark.gpu
@pytest.mark.multiprocess
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (offload moves weights to host memory)")
@pytest.mark.parametrize("overlap", [False, True], ids=["whole step", "overlap_step"])
def test_offload_keeps_weights_off_the_gpu_between_uses(overlap: bool) -> None:
    (result,) = run_ranks(on_one_gpu, 1, overlap, timeout=300)
    print(f"offload on one GPU: {result}")
    assert result["held"] < result["weights"] / 10, result  # the weights left the device
    assert result["gap"] < 1e-5, result  # the CPU's AdamW against the GPU's, in float32


def tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)  # fmt: skip
    return LlamaForCausalLM(config).double()


def overlapped_or_not(overlap: bool) -> dict[str, Any]:
    """Offload v0 over 2 processes (each a copy), ZeRO v1, clipping, an LR schedule and 2 micro-batches a step: the
    losses, what ``engine.parameters()`` reads after each step, the final state, and which threads stepped."""
    import threading

    from epl_memory.overlapped_step import OverlappedHostStep

    threads: list[str] = []
    update = OverlappedHostStep._update

    def recorded(self: OverlappedHostStep, groups: Any) -> None:
        threads.append(threading.current_thread().name.split("_")[0])
        update(self, groups)

    OverlappedHostStep._update = recorded  # type: ignore[method-assign]
    config = {"offload.level": "v0", "zero.level": "v1", "offload.overlap_step": overlap,
              "pipeline.num_micro_batch": 2, "optimizer.max_grad_norm": 0.5}  # fmt: skip
    epl.init(epl.Config(config))
    engine = epl.parallelize(tiny_llama(), optimizer=lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1))
    engine.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda step: 1.0 / (1 + step))
    generator = torch.Generator().manual_seed(5 + engine.replica_index)
    losses, reads = [], []
    for _ in range(4):
        ids = torch.randint(0, 64, (4, 12), generator=generator)
        losses.append(float(engine.step({"input_ids": ids, "labels": ids})))
        reads.append([p.clone() for p in engine.parameters()])
    evaluation = float(engine.evaluate({"input_ids": ids, "labels": ids}))
    return {"losses": losses, "reads": reads, "evaluation": evaluation, "threads": threads,
            "state": engine.state_dict(full=True)["model"]}  # fmt: skip


def overlap_against_whole_steps() -> dict[str, Any]:
    return {"overlapped": overlapped_or_not(True), "whole": overlapped_or_not(False)}


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_step_overlapped_with_the_next_forward_equals_the_whole_step() -> None:
    """``offload.overlap_step``: the CPU's update runs on a worker while the next forward waits block by block; the
    losses, every read between steps and the final weights are bit for bit those of the whole step."""
    for result in run_ranks(overlap_against_whole_steps, 2, timeout=150):
        overlapped, whole = result["overlapped"], result["whole"]
        assert overlapped["threads"] == ["epl-host-step"] * 4, overlapped["threads"]
        assert whole["threads"] == []
        assert repr(overlapped["losses"]) == repr(whole["losses"])
        assert overlapped["evaluation"] == whole["evaluation"]
        for got, expected in zip(overlapped["reads"], whole["reads"], strict=True):
            for a, b in zip(got, expected, strict=True):
                assert torch.equal(a, b)
        for key, value in whole["state"].items():
            assert torch.equal(overlapped["state"][key], value), key
