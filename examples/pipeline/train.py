"""The manual's two-stage pipeline example (the script the user-facing contract is written against).

One process trains it locally (the 4 micro-batches are gradient accumulation);
on 2 processes it is a 2-stage pipeline, on 4 a 2-stage pipeline x 2 replicas:
    python examples/pipeline/train.py
    epl launch --nproc-per-node 4 examples/pipeline/train.py
    epl launch --nproc-per-node 2 examples/pipeline/train.py --strategy ZeroBubble --timeline out/zb
    epl plan --world-size 4 examples/pipeline/train.py
"""

import argparse

import torch
from torch import nn

import epl

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--batch", type=int, default=32)
parser.add_argument("--strategy", default="PreferBackward", help="PreferForward, PreferBackward or ZeroBubble")
parser.add_argument(
    "--timeline",
    help="write the last step's measured timeline to TIMELINE.json (Perfetto) and TIMELINE.png "
    "(matplotlib: pip install 'epl-pipeline[plot]')",
)
args = parser.parse_args()

epl.init(epl.Config({"pipeline.num_micro_batch": 4, "pipeline.strategy": args.strategy}))
torch.manual_seed(0)
with epl.replicate(device_count=1, name="stage_0"):
    stage0 = nn.Sequential(nn.Linear(12, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU())
with epl.replicate(device_count=1, name="stage_1"):
    stage1 = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 12))
model = nn.Sequential(stage0, stage1)

engine = epl.parallelize(model, optimizer=lambda params: torch.optim.Adam(params, lr=1e-3), loss_fn=nn.MSELoss())
rank0 = epl.Env.get().cluster.rank == 0  # one process prints
if rank0:
    print(f"{engine.num_replicas} replica(s) x {engine.plan.num_stages} stage(s), {args.strategy}")

target = nn.Linear(12, 12)  # the function to learn
generator = torch.Generator().manual_seed(engine.replica_index)
with epl.Progress(engine, total=args.steps, log_every=5) as progress:  # rank 0: a bar, or a line every 5 steps
    for _ in range(args.steps):
        x = torch.randn(args.batch, 12, generator=generator)
        with torch.no_grad():
            y = target(x)
        progress.update(engine.step(x, y))  # the replica's mean loss, the same on every stage

if args.timeline and engine.plan.num_stages > 1:
    from epl_pipeline.recording import save_timeline

    bubble = save_timeline(engine, args.timeline)  # every rank takes part; the first of each replica writes
    if rank0:
        print(f"measured bubble of the last step: {bubble:.3f}; timeline in {args.timeline}.png and .json")
