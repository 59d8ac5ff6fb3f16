"""Train a small MLP with DeepSpeed (ZeRO, clipping, accumulation): the original of docs/migration/deepspeed.md.

On 2 GPUs; on 2 CPU processes (DeepSpeed's CPU accelerator on gloo); resumed from the checkpoint of epoch 0:

    deepspeed --num_gpus 2 examples/migration/deepspeed/train_deepspeed.py --zero-stage 2
    torchrun --nproc-per-node 2 examples/migration/deepspeed/train_deepspeed.py --zero-stage 2
    torchrun --nproc-per-node 2 examples/migration/deepspeed/train_deepspeed.py --resume runs/deepspeed/epoch-0
"""

import argparse
import json
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/migration/toy.py
from toy import make_datasets, make_model, warmup_cosine  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="samples per process per micro-batch")
    parser.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2, 3])
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="0: no clipping")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("runs/deepspeed"))
    parser.add_argument("--resume", type=Path, help="a checkpoint (CHECKPOINT_DIR/epoch-N) to resume from")
    parser.add_argument("--metrics-out", type=Path, help="write per-step losses to this JSON file (rank 0)")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return parser.parse_args()


def dtype(model_engine: deepspeed.DeepSpeedEngine) -> torch.dtype:
    """The dtype of the model's weights, which its inputs must have (bf16 and fp16 cast the model)."""
    if model_engine.bfloat16_enabled():
        return torch.bfloat16
    return torch.float16 if model_engine.fp16_enabled() else torch.float32


@torch.no_grad()
def evaluate(model_engine: deepspeed.DeepSpeedEngine, loader: DataLoader, loss_fn: nn.Module) -> float:
    """The mean validation loss over every process's share of the validation set."""
    model_engine.eval()
    total = torch.zeros(2, device=model_engine.device)  # sum of losses, number of samples
    for x, y in loader:
        x, y = x.to(model_engine.device, dtype(model_engine)), y.to(model_engine.device)
        total += torch.stack([loss_fn(model_engine(x).float(), y) * len(y), torch.tensor(len(y), device=x.device)])
    dist.all_reduce(total)
    model_engine.train()
    return (total[0] / total[1]).item()


def main() -> None:
    args = parse_args()
    ds_config = {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": args.max_grad_norm,
        "zero_optimization": {"stage": args.zero_stage},
        "bf16": {"enabled": args.bf16},
    }
    deepspeed.init_distributed()
    rank = dist.get_rank()

    torch.manual_seed(args.seed)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    loss_fn = nn.CrossEntropyLoss()

    train_set, val_set = make_datasets(seed=args.seed)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=DistributedSampler(val_set, shuffle=False))
    total_steps = args.epochs * len(train_loader) // args.grad_accum
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.warmup_steps, total_steps))
    model_engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
    )

    start_epoch = 0
    if args.resume:
        _, client_state = model_engine.load_checkpoint(args.resume.parent, tag=args.resume.name)
        start_epoch = client_state["epoch"] + 1

    metrics = {"loss": [], "lr": [], "grad_norm": [], "val_loss": []}
    micro_losses = []
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        for x, y in train_loader:
            x, y = x.to(model_engine.device, dtype(model_engine)), y.to(model_engine.device)
            lr = scheduler.get_last_lr()[0]
            loss = loss_fn(model_engine(x).float(), y)
            model_engine.backward(loss)  # scaled by 1 / gradient_accumulation_steps
            boundary = model_engine.is_gradient_accumulation_boundary()
            model_engine.step()  # at a boundary: average, clip, update, step the scheduler
            micro_losses.append(loss.item())
            if boundary:
                mean_loss = sum(micro_losses) / len(micro_losses)
                micro_losses = []
                metrics["loss"].append(mean_loss)
                metrics["lr"].append(lr)
                metrics["grad_norm"].append(float(model_engine.get_global_grad_norm()))
                if rank == 0:
                    step = model_engine.global_steps
                    print(f"epoch {epoch} step {step}/{total_steps} loss {mean_loss:.4f} lr {lr:.2e}")
        val_loss = evaluate(model_engine, val_loader, loss_fn)
        metrics["val_loss"].append(val_loss)
        if rank == 0:
            print(f"epoch {epoch} validation loss {val_loss:.4f}")
        model_engine.save_checkpoint(args.checkpoint_dir, tag=f"epoch-{epoch}", client_state={"epoch": epoch})

    if rank == 0 and args.metrics_out:
        args.metrics_out.write_text(json.dumps(metrics))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
