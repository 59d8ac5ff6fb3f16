"""Train a small MLP with EPL: the port of train_accelerate.py in docs/migration/accelerate.md.

On 2 processes (GPUs or CPUs), resumed from the checkpoint of epoch 0, and as one process without a launcher:

    epl launch --nproc-per-node 2 examples/migration/accelerate/train_epl.py
    epl launch --nproc-per-node 2 examples/migration/accelerate/train_epl.py --resume runs/epl/epoch-0
    python examples/migration/accelerate/train_epl.py
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

import epl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/migration/toy.py
from toy import make_datasets, make_model, warmup_cosine  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16, help="samples per replica per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("runs/epl"))
    parser.add_argument("--resume", type=Path, help="a checkpoint directory (epoch-N) to resume from")
    parser.add_argument("--metrics-out", type=Path, help="write per-step losses to this JSON file (rank 0)")
    return parser.parse_args()


def mean_over_processes(value: torch.Tensor) -> float:
    """``value`` averaged over the processes (what ``accelerator.reduce(value, "mean")`` gives)."""
    mean = value.detach().clone()
    epl.Env.get().communicator.all_reduce(mean, epl.ReduceOp.AVG).wait()  # every process is a replica here
    return mean.item()


def evaluate(engine: epl.Engine, loader: torch.utils.data.DataLoader) -> float:
    """The mean validation loss over the whole validation set."""
    engine.eval()
    total = torch.zeros(2)  # sum of losses, number of samples
    for x, y in loader:
        total += torch.stack([engine.evaluate(x, y) * len(y), torch.tensor(len(y))])
    epl.Env.get().communicator.all_reduce(total).wait()
    engine.train()
    return (total[0] / total[1]).item()


def main() -> None:
    args = parse_args()
    # accelerator.clip_grad_norm_ clips the averaged gradients: clip_after_allreduce does the same.
    epl.init(epl.Config({"optimizer.max_grad_norm": args.max_grad_norm, "communication.clip_after_allreduce": True}))
    is_main_process = epl.Env.get().cluster.rank == 0

    torch.manual_seed(args.seed)
    engine = epl.parallelize(
        make_model(),
        optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01),
        loss_fn=nn.CrossEntropyLoss(),
    )

    train_set, val_set = make_datasets(seed=args.seed)
    train_loader = epl.io.data_loader(train_set, args.batch_size, engine, shuffle=True, seed=args.seed, drop_last=True)
    val_loader = epl.io.data_loader(val_set, args.batch_size, engine, shuffle=False)
    # engine.step steps the scheduler once per update: count the schedule in updates.
    total_steps = args.epochs * len(train_loader)
    engine.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
        engine.optimizer, warmup_cosine(args.warmup_steps, total_steps)
    )

    start_epoch = 0
    if args.resume:
        engine.load(args.resume)  # model, optimizer, scheduler, step counter, RNG states
        start_epoch = engine.global_step // len(train_loader)

    metrics = {"loss": [], "lr": [], "grad_norm": [], "val_loss": []}
    for epoch in range(start_epoch, args.epochs):
        train_loader.sampler.set_epoch(epoch)
        for x, y in train_loader:
            lr = engine.lr
            loss = engine.step(x, y)  # forward, backward, gradient average, clipping, optimizer and scheduler
            mean_loss = mean_over_processes(loss)
            metrics["loss"].append(mean_loss)
            metrics["lr"].append(lr)
            metrics["grad_norm"].append(engine.grad_norm)
            if is_main_process:
                print(f"epoch {epoch} step {engine.global_step}/{total_steps} loss {mean_loss:.4f} lr {lr:.2e}")
        val_loss = evaluate(engine, val_loader)
        metrics["val_loss"].append(val_loss)
        if is_main_process:
            print(f"epoch {epoch} validation loss {val_loss:.4f}")
        engine.save(args.checkpoint_dir / f"epoch-{epoch}")  # every rank calls it; atomic

    if is_main_process and args.metrics_out:
        args.metrics_out.write_text(json.dumps(metrics))


if __name__ == "__main__":
    main()
