"""Train a small MLP with Hugging Face Accelerate: the original of docs/migration/accelerate.md.

On 2 GPUs; on 2 CPU processes (torchrun, with ACCELERATE_USE_CPU as `accelerate launch --cpu` sets it);
resumed from the checkpoint of epoch 0:

    accelerate launch --multi_gpu --num_processes 2 examples/migration/accelerate/train_accelerate.py
    ACCELERATE_USE_CPU=1 torchrun --nproc-per-node 2 examples/migration/accelerate/train_accelerate.py
    torchrun --nproc-per-node 2 examples/migration/accelerate/train_accelerate.py --resume runs/accelerate/epoch-0
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from torch import nn
from torch.utils.data import DataLoader

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
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("runs/accelerate"))
    parser.add_argument("--resume", type=Path, help="a checkpoint directory (epoch-N) to resume from")
    parser.add_argument("--metrics-out", type=Path, help="write per-step losses to this JSON file (main process)")
    return parser.parse_args()


@torch.no_grad()
def evaluate(accelerator: Accelerator, model: nn.Module, loader: DataLoader) -> float:
    """The mean validation loss over the whole validation set."""
    model.eval()
    losses = []
    for x, y in loader:
        per_sample = nn.functional.cross_entropy(model(x), y, reduction="none")
        losses.append(accelerator.gather_for_metrics(per_sample))
    model.train()
    return torch.cat(losses).mean().item()


def main() -> None:
    args = parse_args()
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed))

    torch.manual_seed(args.seed)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    loss_fn = nn.CrossEntropyLoss()

    train_set, val_set = make_datasets(seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size)
    model, optimizer, train_loader, val_loader = accelerator.prepare(model, optimizer, train_loader, val_loader)
    # The prepared scheduler steps once per process at every update: count the schedule in those steps.
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        warmup_cosine(args.warmup_steps * accelerator.num_processes, total_steps * accelerator.num_processes),
    )
    scheduler = accelerator.prepare(scheduler)

    start_epoch = 0
    if args.resume:
        accelerator.load_state(args.resume)  # model, optimizer, scheduler, sampler, RNG states
        start_epoch = int(args.resume.name.removeprefix("epoch-")) + 1

    metrics = {"loss": [], "lr": [], "grad_norm": [], "val_loss": []}
    step = start_epoch * len(train_loader)
    for epoch in range(start_epoch, args.epochs):
        train_loader.set_epoch(epoch)  # the seedable sampler's epoch, which load_state does not restore
        for x, y in train_loader:
            lr = scheduler.get_last_lr()[0]
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            accelerator.backward(loss)
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            scheduler.step()
            step += 1
            mean_loss = accelerator.reduce(loss.detach(), reduction="mean").item()  # over the processes
            metrics["loss"].append(mean_loss)
            metrics["lr"].append(lr)
            metrics["grad_norm"].append(grad_norm.item())
            accelerator.print(f"epoch {epoch} step {step}/{total_steps} loss {mean_loss:.4f} lr {lr:.2e}")
        val_loss = evaluate(accelerator, model, val_loader)
        metrics["val_loss"].append(val_loss)
        accelerator.print(f"epoch {epoch} validation loss {val_loss:.4f}")
        accelerator.save_state(args.checkpoint_dir / f"epoch-{epoch}")

    if accelerator.is_main_process and args.metrics_out:
        args.metrics_out.write_text(json.dumps(metrics))
    accelerator.end_training()


if __name__ == "__main__":
    main()
