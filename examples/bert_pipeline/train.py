"""A BERT-style encoder classifier as a 2-stage pipeline (the manual's chapter 8).

Stage 0 holds the embeddings and the lower half of the encoder layers, stage 1 the
upper half and the classifier; each replica batch runs as ``--micro-batches``
micro-batches. On 2 processes: 2 stages; on 4: 2 stages x 2 replicas; on one process
the same script trains locally (the micro-batches are gradient accumulation):

    python examples/bert_pipeline/train.py
    epl launch --nproc-per-node 2 examples/bert_pipeline/train.py
    epl launch --nproc-per-node 4 examples/bert_pipeline/train.py --strategy ZeroBubble
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
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--batch-size", type=int, default=32, help="sequences per replica per step")
parser.add_argument("--micro-batches", type=int, default=4, help="pipeline.num_micro_batch")
parser.add_argument(
    "--strategy", default="PreferBackward", help="PreferForward (GPipe), PreferBackward (1F1B), ZeroBubble"
)
parser.add_argument("--layers", type=int, default=4, help="encoder layers, split evenly over the 2 stages")
parser.add_argument("--hidden", type=int, default=64)
parser.add_argument("--heads", type=int, default=4)
parser.add_argument("--seq-len", type=int, default=32)
parser.add_argument("--vocab", type=int, default=1000)
parser.add_argument("--samples", type=int, default=1024, help="size of the synthetic data set")
args = parser.parse_args()

epl.init(epl.Config({"pipeline.num_micro_batch": args.micro_batches, "pipeline.strategy": args.strategy}))


class Embeddings(nn.Module):
    """Token and learned position embeddings, LayerNorm, dropout (BERT's embedding layer)."""

    def __init__(self, vocab: int, hidden: int, max_len: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, hidden)
        self.positions = nn.Parameter(torch.randn(1, max_len, hidden) * 0.02)
        self.norm = nn.LayerNorm(hidden)
        self.dropout = nn.Dropout(0.1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.norm(self.tokens(ids) + self.positions[:, : ids.shape[1]]))


class Classifier(nn.Module):
    """BERT's pooler (the first token through Linear + tanh) and a linear classifier."""

    def __init__(self, hidden: int, classes: int) -> None:
        super().__init__()
        self.pooler = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, classes)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.pooler(states[:, 0])))


class Bert(nn.Module):
    """Embeddings, encoder layers, classifier; which stage each part runs on is set where it is created."""

    def __init__(self, embeddings: nn.Module, layers: list[nn.Module], classifier: nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings
        self.layers = nn.ModuleList(layers)
        self.classifier = classifier

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        states = self.embeddings(ids)
        for layer in self.layers:
            states = layer(states)
        return self.classifier(states)


def encoder_layer() -> nn.Module:
    return nn.TransformerEncoderLayer(
        args.hidden, args.heads, dim_feedforward=4 * args.hidden, dropout=0.1, activation="gelu", batch_first=True
    )


torch.manual_seed(0)
lower = args.layers // 2
with epl.replicate(device_count=1, name="stage_0"):
    embeddings = Embeddings(args.vocab, args.hidden, args.seq_len)
    layers = [encoder_layer() for _ in range(lower)]
with epl.replicate(device_count=1, name="stage_1"):
    layers += [encoder_layer() for _ in range(args.layers - lower)]
    classifier = Classifier(args.hidden, 2)
model = Bert(embeddings, layers, classifier)
parameters = sum(p.numel() for p in model.parameters())

engine = epl.parallelize(
    model, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3), loss_fn=nn.CrossEntropyLoss()
)

# Synthetic sentences, the same on every rank (seed 0): random words (ids 21..) and, at 4 random places,
# "sentiment" words: ids 1..10 for label 0, 11..20 for label 1. Position 0 is [CLS] (id 0).
generator = torch.Generator().manual_seed(0)
labels = torch.randint(0, 2, (args.samples,), generator=generator)
ids = torch.randint(21, args.vocab, (args.samples, args.seq_len), generator=generator)
places = torch.rand(args.samples, args.seq_len - 1, generator=generator).argsort(1)[:, :4] + 1
words = torch.randint(1, 11, (args.samples, 4), generator=generator) + 10 * labels[:, None]
ids.scatter_(1, places, words)
ids[:, 0] = 0
mine = epl.io.shard(torch.utils.data.TensorDataset(ids, labels), engine=engine)  # this replica's share
loader = torch.utils.data.DataLoader(
    mine, batch_size=args.batch_size, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(1)
)

say(f"bert_pipeline: {parameters:,} parameters, {args.layers} encoder layers, {args.micro_batches} micro-batches")
progress = epl.Progress(engine, total=args.steps)  # rank 0: a bar on a terminal, else plain lines
step = 0
while step < args.steps:
    for x, y in loader:
        step += 1
        progress.update(engine.step(x, y))  # the replica's mean loss, on every stage
        if step == args.steps:
            break

summary("bert_pipeline", engine, progress)  # activations are not measured for pipelines (batch=None)
