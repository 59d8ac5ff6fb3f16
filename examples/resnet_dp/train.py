"""A small ResNet on CIFAR-size synthetic images, data parallel (the manual's chapter 7).

The only EPL lines are the config, ``set_default_strategy(replicate(1))`` and
``epl.parallelize``; the memory techniques are config keys:

    python examples/resnet_dp/train.py                                      # one process
    epl launch --nproc-per-node 2 examples/resnet_dp/train.py               # 2 replicas
    epl launch --nproc-per-node 2 examples/resnet_dp/train.py --checkpointing --zero v1
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
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--batch-size", type=int, default=32, help="images per replica per step")
parser.add_argument("--width", type=int, default=16, help="channels of the first residual stage")
parser.add_argument("--blocks", type=int, default=2, help="residual blocks per stage (3 stages)")
parser.add_argument("--image-size", type=int, default=32)
parser.add_argument("--samples", type=int, default=1024, help="size of the synthetic data set")
parser.add_argument("--checkpointing", action="store_true", help="gradient_checkpoint.type = auto")
parser.add_argument("--amp", action="store_true", help="amp.level = O1 (bfloat16 autocast on CPU)")
parser.add_argument("--zero", choices=["v0", "v1", "v2"], help="zero.level")
parser.add_argument("--micro-batches", type=int, default=1, help="gradient accumulation (pipeline.num_micro_batch)")
args = parser.parse_args()

config = {"pipeline.num_micro_batch": args.micro_batches}
if args.checkpointing:
    config["gradient_checkpoint.type"] = "auto"
if args.amp:
    config["amp.level"] = "O1"
if args.zero:
    config["zero.level"] = args.zero
epl.init(epl.Config(config))
epl.set_default_strategy(epl.replicate(device_count=1))  # every module below: one device per replica


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a shortcut (a 1x1 convolution where the shape changes)."""

    def __init__(self, channels_in: int, channels: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(channels_in, channels, 3, stride, 1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(inplace=True),
            nn.Conv2d(channels, channels, 3, 1, 1, bias=False),
            nn.BatchNorm2d(channels),
        )
        self.shortcut = nn.Identity()
        if stride != 1 or channels_in != channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels, 1, stride, bias=False), nn.BatchNorm2d(channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class ResNet(nn.Module):
    """CIFAR ResNet: a stem, three stages of ``blocks`` residual blocks (width, 2x, 4x), pooling, a classifier."""

    def __init__(self, width: int, blocks: int, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers, channels = [], width
        for stage, out in enumerate((width, 2 * width, 4 * width)):
            for block in range(blocks):
                layers.append(BasicBlock(channels, out, 2 if stage > 0 and block == 0 else 1))
                channels = out
        self.blocks = nn.Sequential(*layers)  # what gradient_checkpoint.type=auto checkpoints
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


torch.manual_seed(0)
model = ResNet(args.width, args.blocks)
parameters = sum(p.numel() for p in model.parameters())
engine = epl.parallelize(
    model,
    optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=5e-4),
    loss_fn=nn.CrossEntropyLoss(),
)

# Synthetic images: noise plus a faint pattern per class, the same data set on every rank (seed 0).
generator = torch.Generator().manual_seed(0)
size = args.image_size
patterns = torch.randn(10, 3, size, size, generator=generator)
labels = torch.randint(0, 10, (args.samples,), generator=generator)
images = torch.randn(args.samples, 3, size, size, generator=generator) + 0.5 * patterns[labels]
dataset = torch.utils.data.TensorDataset(images, labels)
mine = epl.io.shard(dataset, engine=engine)  # this replica's share: samples r, r+R, r+2R, ...
loader = torch.utils.data.DataLoader(
    mine, batch_size=args.batch_size, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(1)
)

say(f"resnet_dp: {parameters:,} parameters, config {config}")
progress = epl.Progress(engine, total=args.steps)  # rank 0: a bar on a terminal, else plain lines
step = 0
while step < args.steps:
    for x, y in loader:
        step += 1
        progress.update(engine.step(x, y))
        if step == args.steps:
            break

summary("resnet_dp", engine, progress, batch=(x, y))  # every rank: the memory report is gathered
