"""torch.distributed on CUDA: NCCL carries CUDA tensors and gloo the CPU ones, in one process group.

EPL's own small collectives (the batch check's fingerprints, a broadcast of weights still in host
memory) travel as CPU tensors; under plain NCCL they fail ("No backend type associated with device
type cpu"). Skipped without CUDA; the multi-GPU tests skip, saying so, on a machine with one GPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import epl
from tests.helpers.distributed import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cpu_and_cuda_collectives() -> dict[str, Any]:
    from epl.interfaces.cluster import Cluster
    from epl_comm.torch_communicator import TorchCommunicator

    cluster = Cluster.from_environ()
    world = TorchCommunicator.join(cluster, timeout=60)
    on_cpu, on_cuda = torch.ones(3), torch.ones(3, device=cluster.device)
    world.all_reduce(on_cpu).wait()
    world.all_reduce(on_cuda).wait()
    gathered = torch.empty(3 * world.world_size, dtype=torch.float64)
    world.all_gather(gathered, torch.full((3,), float(cluster.rank), dtype=torch.float64)).wait()
    return {"cpu": on_cpu.tolist(), "cuda": on_cuda.cpu().tolist(), "gathered": gathered.tolist()}


def test_one_process_group_carries_cpu_and_cuda_tensors() -> None:
    world_size = min(_gpus(), 2)
    for got in run_ranks(cpu_and_cuda_collectives, world_size, timeout=120):
        assert got["cpu"] == got["cuda"] == [float(world_size)] * 3
        assert got["gathered"] == [float(r) for r in range(world_size) for _ in range(3)]


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)) for _ in range(3)]


def train(replicas: int) -> dict[str, Any]:
    epl.init()
    with epl.replicate(device_count=1):
        model = build()
    engine = epl.parallelize(model, optimizer=lambda p: torch.optim.Adam(p, lr=1e-2), loss_fn=nn.MSELoss())
    losses = []
    for x, y in batches():
        share = slice(engine.replica_index * 8 // replicas, (engine.replica_index + 1) * 8 // replicas)
        losses.append(float(engine.step(x[share], y[share])))
    return {"losses": losses, "weights": [p.detach().cpu() for p in engine.model.parameters()]}


def mismatched_batches() -> str:
    epl.init()
    with epl.split(2):
        model = build()
    engine = epl.parallelize(model, optimizer=lambda p: torch.optim.Adam(p, lr=1e-2), loss_fn=nn.MSELoss())
    x, y = batches()[0]
    try:
        engine.step(x + epl.Env.get().cluster.rank, y)
    except epl.EplError as error:
        return str(error)
    return "no error"


@pytest.mark.skipif(_gpus() < 2, reason=f"needs 2 GPUs for NCCL between processes; this machine has {_gpus()}")
def test_data_parallel_on_two_gpus_equals_one_gpu() -> None:
    expected = run_ranks(train, 1, 1, timeout=120)[0]
    got = run_ranks(train, 2, 2, timeout=180)
    for rank in got:
        for ours, theirs in zip(rank["weights"], expected["weights"], strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(_gpus() < 2, reason=f"needs 2 GPUs for NCCL between processes; this machine has {_gpus()}")
def test_the_batch_check_works_over_nccl() -> None:
    for message in run_ranks(mismatched_batches, 2, timeout=180):
        assert "were given different batches" in message, message


#: Wide enough that each activation and gradient message (1024 rows x 2048 float32, 8 MiB) exceeds NCCL's
#: 4 MiB buffers, so a send waits for its receive: the case where one stream for both directions would hang.
WIDE, ROWS, PIPELINE_MICRO = 2048, 4096, 4


def pipeline_train(strategy: str) -> dict[str, Any]:
    """2 stages (one process per GPU), or the same script in one process: losses and every weight."""
    epl.init(epl.Config({"pipeline.num_micro_batch": PIPELINE_MICRO, "pipeline.strategy": strategy}))
    torch.manual_seed(0)
    with epl.replicate(device_count=1, name="stage_0"):
        first = nn.Sequential(nn.Linear(WIDE, WIDE), nn.ReLU())
    with epl.replicate(device_count=1, name="stage_1"):
        second = nn.Sequential(nn.Linear(WIDE, WIDE), nn.ReLU(), nn.Linear(WIDE, 4))
    engine = epl.parallelize(
        nn.Sequential(first, second), optimizer=lambda p: torch.optim.SGD(p, lr=1e-2), loss_fn=nn.MSELoss()
    )
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(2):
        x, y = torch.randn(ROWS, WIDE, generator=generator), torch.randn(ROWS, 4, generator=generator)
        losses.append(float(engine.step(x, y)))
    return {"losses": losses, "state": {k: v.detach().cpu() for k, v in engine.model.state_dict().items()}}


@pytest.mark.timeout(300)
@pytest.mark.skipif(_gpus() < 2, reason=f"needs 2 GPUs for NCCL between processes; this machine has {_gpus()}")
@pytest.mark.parametrize("strategy", ["PreferBackward", "ZeroBubble"])
def test_two_pipeline_stages_on_two_gpus_equal_one_gpu(strategy: str) -> None:
    """Messages larger than NCCL's buffers both ways, receives posted ahead: nothing hangs, and the step (losses,
    the loss all-reduce over stages on the GPUs, every weight) equals the same script on one GPU."""
    expected = run_ranks(pipeline_train, 1, strategy, timeout=120)[0]
    got = run_ranks(pipeline_train, 2, strategy, timeout=240)
    for rank in got:
        assert rank["losses"] == pytest.approx(expected["losses"], rel=1e-5)
        for name, value in rank["state"].items():
            torch.testing.assert_close(value, expected["state"][name], rtol=1e-4, atol=1e-5, msg=name)
