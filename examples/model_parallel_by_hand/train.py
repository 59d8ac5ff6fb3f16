"""The eight-layer model of pytorch_model_parallel_by_hand.md, placed by EPL annotations instead of ``.to(device)``.

The original puts layers 1-2 on cuda:0, 3-4 on cuda:1, 5-6 on cuda:2 and 7-8 on cuda:3
and moves every activation by hand. Here each group of layers is created under
``epl.replicate(device_count=1, name="stage_k")``; ``forward`` has no ``.to`` left, and
EPL runs the groups as pipeline stages (with micro-batches, which the original lacks):

    python examples/model_parallel_by_hand/train.py                                  # one process
    epl launch --nproc-per-node 2 examples/model_parallel_by_hand/train.py           # 2 stages of 4 layers
    epl launch --nproc-per-node 4 examples/model_parallel_by_hand/train.py --stages 4  # the original's 4 devices
"""

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

import epl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/reporting.py
from reporting import say, summary  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--stages", type=int, default=2, choices=[1, 2, 4, 8], help="pipeline stages (the original: 4)")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--steps", type=int, default=None, help="stop after this many steps (default: all epochs)")
parser.add_argument("--batch-size", type=int, default=64, help="samples per replica per step")
parser.add_argument("--micro-batches", type=int, default=4, help="pipeline.num_micro_batch")
parser.add_argument("--samples", type=int, default=1024, help="size of the synthetic training set")
args = parser.parse_args()

epl.init(epl.Config({"pipeline.num_micro_batch": args.micro_batches}))

WIDTHS = (12, 256, 128, 64, 8, 64, 128, 256, 12)  # layer k maps WIDTHS[k-1] features to WIDTHS[k]


class my_model(nn.Module):  # noqa: N801 (the original's name)
    def __init__(self, stages: int) -> None:
        super().__init__()
        self.relu = nn.ReLU()
        per_stage = 8 // stages  # the original: 2 layers on each of 4 devices
        for stage in range(stages):
            with epl.replicate(device_count=1, name=f"stage_{stage}"):  # instead of .to(device{stage})
                for k in range(stage * per_stage + 1, (stage + 1) * per_stage + 1):
                    setattr(self, f"layer{k}", nn.Linear(WIDTHS[k - 1], WIDTHS[k]))

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.layer1(inp))
        x = self.relu(self.layer2(x))
        x = self.relu(self.layer3(x))
        x = self.relu(self.layer4(x))
        x = self.relu(self.layer5(x))
        x = self.relu(self.layer6(x))
        x = self.relu(self.layer7(x))
        x = self.layer8(x)
        return x


# Build and define your model
torch.manual_seed(0)
model = my_model(args.stages)

# The loss function and the optimizer go to EPL, which builds the optimizer over this rank's layers
engine = epl.parallelize(model, optimizer=lambda params: torch.optim.Adam(params=params), loss_fn=nn.MSELoss())

# Synthetic regression data, the same on every rank (seed 0): 12 features -> 12 targets of a fixed smooth function.
generator = torch.Generator().manual_seed(0)
features = torch.randn(args.samples, 12, generator=generator)
mixing = torch.randn(12, 12, generator=generator) / 12**0.5
targets = torch.tanh(features @ mixing)
train_set = epl.io.shard(torch.utils.data.TensorDataset(features, targets), engine=engine)  # this replica's share
train_loader = torch.utils.data.DataLoader(
    train_set, batch_size=args.batch_size, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(1)
)

steps = args.epochs * len(train_loader) if args.steps is None else args.steps
say(f"model_parallel_by_hand: 8 layers on {args.stages} stage(s), {args.micro_batches} micro-batches, {steps} steps")
progress = epl.Progress(engine, total=steps)  # rank 0: a bar on a terminal, else plain lines
step, epoch = 0, 0
while step < steps:
    engine.train()
    train_loss = 0.0
    for train_x, train_y in train_loader:
        loss = engine.step(train_x, train_y)  # forward, backward and update of every micro-batch, all stages
        train_loss += float(loss)
        step += 1
        progress.update(loss)
        if step == steps:
            break
    epoch += 1
    say(f"Epoch : {epoch} | train_Loss: {train_loss / len(train_loader):.5f}")

summary("model_parallel_by_hand", engine, progress)
