"""A T5/Switch-style mixture-of-experts transformer with expert parallelism (the manual's chapter 9).

The manual's recipe: the dense part (embeddings, attention, gates, head) is replicated
by default over every device, the experts are split, and both are colocated on the same
devices. On n processes each device holds ``--experts / n`` experts of every layer and
a 1/n share of each batch; tokens travel to their experts and back by all-to-all:

    python examples/moe_transformer/train.py
    epl launch --nproc-per-node 2 examples/moe_transformer/train.py
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import epl
from epl.nn import Experts, MoE, TopKGate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/reporting.py
from reporting import say, summary  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--batch-size", type=int, default=16, help="sequences per replica per step")
parser.add_argument("--layers", type=int, default=2)
parser.add_argument("--hidden", type=int, default=64)
parser.add_argument("--heads", type=int, default=4)
parser.add_argument("--experts", type=int, default=4, help="experts per layer (a multiple of the process count)")
parser.add_argument("--top-k", type=int, default=2, choices=[1, 2], help="1: Switch, 2: GShard")
parser.add_argument("--capacity-factor", type=float, default=1.25)
parser.add_argument("--aux-loss", type=float, default=0.01, help="weight of the gates' load-balancing loss")
parser.add_argument("--seq-len", type=int, default=32)
parser.add_argument("--vocab", type=int, default=512)
parser.add_argument("--samples", type=int, default=1024, help="size of the synthetic data set")
args = parser.parse_args()

env = epl.init(epl.Config({"cluster.colocate_split_and_replicate": True}))
devices = env.cluster.total_gpu_num  # 1 in a local run


class MoELayer(nn.Module):
    """A pre-norm (T5) encoder layer whose feed-forward network is a mixture of experts."""

    def __init__(self, attention: nn.MultiheadAttention, moe: MoE, hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(hidden)
        self.attention = attention
        self.norm2 = nn.RMSNorm(hidden)
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        return x + self.moe(self.norm2(x))  # tokens an expert has no room for pass by the residual


class MoETransformer(nn.Module):
    """Token embeddings (with a learned position bias), MoE encoder layers, a final norm and a token head."""

    def __init__(self, layers: list[MoELayer]) -> None:
        super().__init__()
        self.embedding = nn.Embedding(args.vocab, args.hidden)
        self.positions = nn.Parameter(torch.randn(1, args.seq_len, args.hidden) * 0.02)
        self.layers = nn.ModuleList(layers)
        self.norm = nn.RMSNorm(args.hidden)
        self.head = nn.Linear(args.hidden, args.vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding(ids) + self.positions
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


torch.manual_seed(0)
epl.set_default_strategy(epl.replicate(devices, name="dense"))  # attention, gates, embeddings, head
layers = []
for index in range(args.layers):
    attention = nn.MultiheadAttention(args.hidden, args.heads, batch_first=True)
    # Tokens are routed sequence by sequence (group_size), so one process routes exactly like n.
    gate = TopKGate(
        args.hidden, args.experts, k=args.top_k, capacity_factor=args.capacity_factor, group_size=args.seq_len
    )
    with epl.split(devices, name=f"experts_{index}"):  # expert parallel: experts / devices on each device
        experts = Experts(args.experts, args.hidden, 4 * args.hidden)
    layers.append(MoELayer(attention, MoE(gate, experts), args.hidden))
model = MoETransformer(layers)
parameters = sum(p.numel() for p in model.parameters())
gates = [layer.moe.gate for layer in layers]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every token, plus the gates' load-balancing loss of this forward."""
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    return loss + args.aux_loss * sum(gate.aux_loss for gate in gates)


engine = epl.parallelize(model, optimizer=lambda params: torch.optim.AdamW(params, lr=2e-3), loss_fn=loss_fn)

# Synthetic "translation", the same on every rank (seed 0): each target token is a fixed word-for-word
# translation of the source token at the same place, mixed with the token before it.
generator = torch.Generator().manual_seed(0)
dictionary = torch.randperm(args.vocab, generator=generator)
source = torch.randint(0, args.vocab, (args.samples, args.seq_len), generator=generator)
previous = torch.cat([torch.zeros_like(source[:, :1]), source[:, :-1]], 1)
target = dictionary[(source + (previous % 2)) % args.vocab]
mine = epl.io.shard(torch.utils.data.TensorDataset(source, target), engine=engine)  # this replica's share
loader = torch.utils.data.DataLoader(
    mine, batch_size=args.batch_size, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(1)
)

say(
    f"moe_transformer: {parameters:,} parameters, {args.layers} layers x {args.experts} experts "
    f"(top-{args.top_k}, capacity factor {args.capacity_factor})"
)
progress = epl.Progress(engine, total=args.steps)  # rank 0: a bar on a terminal, else plain lines
step = 0
while step < args.steps:
    for x, y in loader:
        step += 1
        progress.update(engine.step(x, y))  # each device of the replica computes its share of x
        if step == args.steps:
            break

routing = [layer.moe.last_routing for layer in engine.model.layers]
kept = ", ".join(f"layer {i}: {len(r.token)} kept, {r.dropped} dropped" for i, r in enumerate(routing))
held = engine.model.layers[0].moe.experts.w_in.shape[0]  # experts are stacked along dimension 0
summary(
    "moe_transformer",
    engine,
    progress,
    batch=(x, y),
    extra=[
        f"routing:    (token, choice) pairs of rank 0's last step: {kept}",
        f"experts:    each rank holds {held} of the {args.experts} experts of every layer",
    ],
)
