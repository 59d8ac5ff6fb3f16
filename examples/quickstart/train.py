"""The manual's quick start (chapter 3) in PyTorch: a small DNN, data parallel by annotation.

Run it as is (one process), on 2 processes, or ask what it would do on 8 devices:
    python examples/quickstart/train.py
    torchrun --nproc-per-node 2 examples/quickstart/train.py
    epl plan --world-size 8 examples/quickstart/train.py
"""

import torch
from torch import nn

import epl

epl.init()
epl.set_default_strategy(epl.replicate(1))

torch.manual_seed(0)
features = torch.randint(0, 10, (500, 20)).float()
labels = torch.randint(0, 10, (500,))
model = nn.Sequential(nn.Linear(20, 2), nn.Linear(2, 10))

engine = epl.parallelize(
    model,
    optimizer=lambda params: torch.optim.SGD(params, lr=0.001, momentum=0.9),
    loss_fn=nn.CrossEntropyLoss(),
)
mine = torch.tensor(epl.io.shard(range(len(features)), engine=engine))  # each replica reads its own share
rank0 = epl.Env.get().cluster.rank == 0  # one process prints
batch = 10
for step in range(10):
    rows = mine[step * batch : (step + 1) * batch]
    loss = engine.step(features[rows], labels[rows])  # the mean loss of replica 0's batch on rank 0
    if rank0:
        print(f"[{engine.num_replicas} replica(s)] Iteration {step + 1} , Loss: {loss.item():.4f} .")
if rank0:
    print("Train Finished.")
