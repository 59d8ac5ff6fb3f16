"""Train a small MLP with PyTorch DistributedDataParallel: the original of docs/migration/ddp.md.

On 2 processes (GPUs with NCCL, or CPUs with gloo), then resumed from the checkpoint of epoch 0:

    torchrun --nproc-per-node 2 examples/migration/ddp/train_ddp.py
    torchrun --nproc-per-node 2 examples/migration/ddp/train_ddp.py --resume runs/ddp/epoch-0.pt
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/migration/toy.py
from toy import make_datasets, make_model, warmup_cosine  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16, help="samples per process per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("runs/ddp"))
    parser.add_argument("--resume", type=Path, help="a checkpoint file to resume from")
    parser.add_argument("--metrics-out", type=Path, help="write per-step losses to this JSON file (rank 0)")
    return parser.parse_args()


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, loss_fn: nn.Module, device: torch.device) -> float:
    """The mean validation loss over every process's share of the validation set."""
    model.eval()
    total = torch.zeros(2, device=device)  # sum of losses, number of samples
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        total += torch.stack([loss_fn(model(x), y) * len(y), torch.tensor(len(y), device=device)])
    dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def main() -> None:
    args = parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)

    torch.manual_seed(args.seed)
    model = DistributedDataParallel(make_model().to(device), device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    loss_fn = nn.CrossEntropyLoss()

    train_set, val_set = make_datasets(seed=args.seed)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=DistributedSampler(val_set, shuffle=False))
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.warmup_steps, total_steps))

    start_epoch = 0
    if args.resume:
        state = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch = state["epoch"] + 1

    metrics = {"loss": [], "lr": [], "grad_norm": [], "val_loss": []}
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        for x, y in train_loader:
            x, y = x.to(device), y.to(device)
            lr = scheduler.get_last_lr()[0]
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()  # DDP averages the gradients over the processes here
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            scheduler.step()
            metrics["loss"].append(loss.item())
            metrics["lr"].append(lr)
            metrics["grad_norm"].append(grad_norm.item())
            if rank == 0:
                print(f"epoch {epoch} step {scheduler.last_epoch}/{total_steps} loss {loss.item():.4f} lr {lr:.2e}")
        val_loss = evaluate(model, val_loader, loss_fn, device)
        metrics["val_loss"].append(val_loss)
        if rank == 0:
            print(f"epoch {epoch} validation loss {val_loss:.4f}")
            args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            state = {
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "epoch": epoch,
            }
            torch.save(state, args.checkpoint_dir / f"epoch-{epoch}.pt")
        dist.barrier()  # the others wait until the checkpoint is written

    if rank == 0 and args.metrics_out:
        args.metrics_out.write_text(json.dumps(metrics))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
