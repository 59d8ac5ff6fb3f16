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
