"""A job that survives a failure: checkpoints every few steps, and `epl launch --max-restarts` starts it again.

    epl launch --nproc-per-node 2 --max-restarts 2 examples/resume/train.py --fail-once-at 7

On each start the script loads its last checkpoint (if there is one) and goes on from that step, its
data loader from where it stood (the checkpoint records it); `--fail-once-at STEP` makes rank 1 crash at
that step on the first start only (EPL_RESTART_COUNT is 0), to show the restart. See README.md beside this
file.
"""

import argparse
import json
import os
from pathlib import Path

import torch
from torch import nn

import epl

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--save-every", type=int, default=3, help="steps between checkpoints")
parser.add_argument("--checkpoint", type=Path, default=Path("out/resume/checkpoint"))
parser.add_argument("--fail-once-at", type=int, default=None, help="rank 1 crashes at this step on the first start")
parser.add_argument("--result", type=Path, default=None, help="write the final weights and losses here (JSON)")
args = parser.parse_args()

epl.init()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
engine = epl.parallelize(
    model,
    optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
    loss_fn=nn.MSELoss(),
    lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps),
)
samples = torch.Generator().manual_seed(1)  # its own generator: engine.load restores the global RNG's state
data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=samples), torch.randn(64, 1, generator=samples))
loader = epl.io.data_loader(data, batch_size=4, engine=engine, drop_last=True)
if args.checkpoint.exists():
    engine.load(args.checkpoint)  # weights, optimizer, LR scheduler, step counter, RNG states, the loader's place
restart = int(os.environ.get("EPL_RESTART_COUNT", "0"))
epoch = loader.sampler.epoch  # the checkpoint's epoch (0 on a first start)
losses = []
with epl.Progress(engine, total=args.steps, log_every=1) as progress:
    while engine.global_step < args.steps:
        loader.sampler.set_epoch(epoch)
        for x, y in loader:  # after a load: the rest of the checkpoint's epoch
            loss = engine.step(x, y)
            losses.append(float(loss))
            progress.update(loss)
            step = engine.global_step
            if step == args.fail_once_at and restart == 0 and epl.Env.get().cluster.rank == 1:
                raise SystemExit(f"rank 1: a simulated crash at step {step}")
            if step % args.save_every == 0:
                engine.save(args.checkpoint)
            if step == args.steps:
                break
        epoch += 1

if args.result is not None and epl.Env.get().cluster.rank == 0:
    weights = {name: value.tolist() for name, value in engine.model.state_dict().items()}
    args.result.write_text(json.dumps({"weights": weights, "losses": losses, "restart": restart}))
