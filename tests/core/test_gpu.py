"""CUDA paths of the core: device by local rank, and the local run on a GPU. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import epl
from epl.interfaces.cluster import Cluster

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_device_is_the_local_rank_gpu() -> None:
    cluster = Cluster.from_environ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    assert cluster.device == torch.device("cuda", 0)


def test_local_run_on_gpu_matches_plain_pytorch_on_gpu() -> None:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))

    torch.manual_seed(1)
    batches = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(4)]
    plain = build().cuda()
    opt = torch.optim.Adam(plain.parameters(), lr=1e-2)
    expected = []
    for x, y in batches:
        opt.zero_grad()
        loss = nn.functional.mse_loss(plain(x.cuda()), y.cuda())
        loss.backward()
        opt.step()
        expected.append(loss.detach())

    epl.init()
    with epl.replicate(1):
        model = build()
    engine = epl.parallelize(model, optimizer=lambda p: torch.optim.Adam(p, lr=1e-2), loss_fn=nn.MSELoss())
    losses = [engine.step(x, y) for x, y in batches]  # CPU batches: the engine moves them
    assert next(engine.model.parameters()).device.type == "cuda"
    assert torch.equal(torch.stack(losses), torch.stack(expected))
    for ours, theirs in zip(engine.model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(ours, theirs)


def test_nonfinite_step_is_skipped_on_gpu() -> None:
    """An Inf batch on a GPU: the update is skipped, the weights stay, the next good step trains (issue 40)."""
    epl.init()
    torch.manual_seed(0)
    with epl.replicate(1):
        model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    engine = epl.parallelize(model, optimizer=lambda p: torch.optim.Adam(p, lr=1e-2), loss_fn=nn.MSELoss())
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    engine.step(x, y)
    before = [p.detach().clone() for p in engine.parameters()]
    bad = x.clone()
    bad[0, 0] = float("inf")  # tanh keeps the loss finite; the first layer's gradient is not
    engine.step(bad, y)
    assert engine.skipped_steps == 1 and engine.last_step_skipped
    assert all(torch.equal(a, b) for a, b in zip(before, engine.parameters(), strict=True))
    engine.step(x, y)
    assert engine.skipped_steps == 1 and not engine.last_step_skipped
    assert all(torch.isfinite(p).all() for p in engine.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nonfinite_gradients_on_gpu_read_huge_finite_values_as_finite(dtype: torch.dtype) -> None:
    from epl.runtime.nonfinite import nonfinite_gradients

    param = nn.Parameter(torch.zeros(1024, device="cuda", dtype=dtype))
    param.grad = torch.full_like(param, torch.finfo(dtype).max)  # a 2-norm of these would overflow
    assert float(nonfinite_gradients([param], torch.device("cuda"))) == 0.0
    param.grad[7] = float("nan")
    assert float(nonfinite_gradients([param], torch.device("cuda"))) == 1.0


def test_ids_outside_the_vocabulary_are_named_on_gpu() -> None:
    from epl.errors import VocabularyError
    from epl.sharding.vocabulary import check_in_vocabulary

    ids = torch.randint(0, 256, (2, 128), device="cuda")
    check_in_vocabulary(ids, 256, "The token ids")
    ids[1, 5] = 300
    with pytest.raises(VocabularyError, match="300"):
        check_in_vocabulary(ids, 256, "The token ids")
