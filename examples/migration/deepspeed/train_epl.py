"""Train a small MLP with EPL (ZeRO, clipping, accumulation): the port of train_deepspeed.py in
docs/migration/deepspeed.md.

On 2 processes (GPUs or CPUs), resumed from the checkpoint of epoch 0, and as one process without a launcher:

    epl launch --nproc-per-node 2 examples/migration/deepspeed/train_epl.py --zero-stage 2
    epl launch --nproc-per-node 2 examples/migration/deepspeed/train_epl.py --resume runs/epl/epoch-0
    python examples/migration/deepspeed/train_epl.py
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

#: DeepSpeed's ZeRO stage -> EPL's zero.level (EPL counts from v0 = optimizer states).
ZERO_LEVEL = {0: "", 1: "v0", 2: "v1", 3: "v2"}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="samples per replica per micro-batch")
    parser.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2, 3])
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast (AMP O1), not a bfloat16 model")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="0: no clipping")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("runs/epl"))
    parser.add_argument("--resume", type=Path, help="a checkpoint (CHECKPOINT_DIR/epoch-N) to resume from")
    parser.add_argument("--metrics-out", type=Path, help="write per-step losses to this JSON file (rank 0)")
    return parser.parse_args()


def evaluate(engine: epl.Engine, loader: torch.utils.data.DataLoader) -> float:
    """The mean validation loss over every replica's share of the validation set."""
    engine.eval()
    total = torch.zeros(2)  # sum of losses, number of samples
    for x, y in loader:
        total += torch.stack([engine.evaluate(x, y) * len(y), torch.tensor(len(y))])
    epl.Env.get().communicator.all_reduce(total).wait()
    engine.train()
    return (total[0] / total[1]).item()


def main() -> None:
    args = parse_args()
    config = {
        "pipeline.num_micro_batch": args.grad_accum,  # gradient accumulation: each batch in grad_accum parts
        "optimizer.max_grad_norm": args.max_grad_norm or None,  # 0: no clipping, as DeepSpeed's 0
        # DeepSpeed clips the averaged gradients; so does EPL with this key (ZeRO always does: docs/zero.md).
        "communication.clip_after_allreduce": True,
        "zero.level": ZERO_LEVEL[args.zero_stage],
    }
    if args.bf16:
        config.update({"amp.level": "O1", "amp.dtype": "bfloat16"})
    epl.init(epl.Config(config))
    rank = epl.Env.get().cluster.rank

    torch.manual_seed(args.seed)
    engine = epl.parallelize(
        make_model(),
        optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01),
        loss_fn=nn.CrossEntropyLoss(),
    )

    train_set, val_set = make_datasets(seed=args.seed)
    batch_size = args.batch_size * args.grad_accum  # the replica batch of one optimizer step
    train_loader = epl.io.data_loader(train_set, batch_size, engine, shuffle=True, seed=args.seed, drop_last=True)
    val_loader = epl.io.data_loader(val_set, args.batch_size, engine, shuffle=False)
    total_steps = args.epochs * len(train_loader)
    engine.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
        engine.optimizer, warmup_cosine(args.warmup_steps, total_steps)
    )

    start_epoch = 0
    if args.resume:
        engine.load(args.resume)  # model, optimizer states (each owner its own), scheduler, step, RNG states
        start_epoch = engine.global_step // len(train_loader)

    metrics = {"loss": [], "lr": [], "grad_norm": [], "val_loss": []}
    for epoch in range(start_epoch, args.epochs):
        train_loader.sampler.set_epoch(epoch)
        for x, y in train_loader:
            lr = engine.lr
            loss = engine.step(x, y)  # grad_accum micro-batches, average, clip, update, step the scheduler
            metrics["loss"].append(loss.item())
            metrics["lr"].append(lr)
            metrics["grad_norm"].append(engine.grad_norm)
            if rank == 0:
                print(f"epoch {epoch} step {engine.global_step}/{total_steps} loss {loss.item():.4f} lr {lr:.2e}")
        val_loss = evaluate(engine, val_loader)
        metrics["val_loss"].append(val_loss)
        if rank == 0:
            print(f"epoch {epoch} validation loss {val_loss:.4f}")
        engine.save(args.checkpoint_dir / f"epoch-{epoch}")  # every rank calls it; atomic

    if rank == 0 and args.metrics_out:
        args.metrics_out.write_text(json.dumps(metrics))


if __name__ == "__main__":
    main()
