"""Fine-tune a pretrained Llama on tokenised, packed text under any layout, evaluate it, export it, generate.

The whole path most users take, with nothing downloaded: at first run a small Llama is written by
transformers itself (the "pretrained" base) and a byte-level BPE tokenizer is trained on Python's own
reference documentation (``pydoc_data.topics``, installed with Python); both are kept in ``--cache``.
Every paragraph is a document; documents are packed into rows of ``--seq-len`` tokens whose position ids
restart at each document, so attention never crosses one (transformers builds the block-diagonal mask from
them) and no token is predicted from another document.

    python examples/finetune/train.py                                           # one process
    epl launch --nproc-per-node 2 examples/finetune/train.py                    # 2 replicas (data parallel)
    epl launch --nproc-per-node 2 examples/finetune/train.py --layout split     # tensor parallel
    epl launch --nproc-per-node 2 examples/finetune/train.py --layout pipeline  # 2 automatic stages
    epl launch --nproc-per-node 4 examples/finetune/train.py --layout 3d        # split(2) x 2 stages
    epl launch --nproc-per-node 2 examples/finetune/train.py --layout zero2 --lora
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import epl

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from packing import pack  # noqa: E402  (examples/finetune/packing.py)
from reporting import is_rank0, layout, say  # noqa: E402  (examples/reporting.py)

HERE = Path(__file__).resolve().parent

#: --layout: the config keys each sets (docs/config.md); "split" also builds the model in epl.split(n).
LAYOUTS: dict[str, dict[str, Any]] = {
    "dp": {},
    "zero2": {"zero.level": "v2"},
    "split": {},
    "pipeline": {"auto.auto_parallel": True, "pipeline.num_micro_batch": 2},
    "3d": {"auto.auto_parallel": True, "pipeline.num_micro_batch": 2},
}
#: Layouts cut into --stages pipeline stages.
PIPELINED = {"pipeline", "3d"}
#: The tensor-parallel degree of each layout (0: every process of the job, one replica).
SPLIT = {"split": 0, "3d": 2}

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--layout", choices=sorted(LAYOUTS), default="dp", help="how the job is laid out (default dp)")
parser.add_argument("--config", default="{}", help='more epl.Config keys as JSON, e.g. \'{"zero.level": "v1"}\'')
parser.add_argument("--stages", type=int, default=2, help="pipeline stages of --layout pipeline and 3d")
parser.add_argument("--lora", action="store_true", help="train LoRA adapters (peft) instead of every weight")
parser.add_argument("--merged", action="store_true", help="with --lora: export the base with the adapters merged")
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--eval-every", type=int, default=20, help="evaluate on the held-out split every N steps")
parser.add_argument("--eval-batches", type=int, default=4, help="held-out batches per evaluation")
parser.add_argument("--batch-size", type=int, default=8, help="packed rows per replica per step")
parser.add_argument("--seq-len", type=int, default=128, help="tokens per packed row")
parser.add_argument("--lr", type=float, default=None, help="AdamW's learning rate (default 3e-3; 1e-2 with --lora)")
parser.add_argument("--documents", type=int, default=0, help="use only the first N paragraphs (0: all)")
parser.add_argument("--cache", default=str(HERE / "cache"), help="where the base model and tokenizer are kept")
parser.add_argument("--out", default=str(HERE / "cache" / "finetuned"), help="the export's folder")
parser.add_argument("--generate", default="The import statement", help="the prompt the export continues")
args = parser.parse_args()


# -- 1. The pretrained base and the tokenizer, written once (by whichever process comes first) -------------
@contextlib.contextmanager
def exclusive(folder: Path) -> Iterator[None]:
    """One process at a time (the ranks of a job start together; the first one writes the cache)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def paragraphs() -> list[str]:
    """Python's reference documentation (the text `help("topic")` shows), one document per paragraph."""
    from pydoc_data.topics import topics

    found = []
    for name in sorted(topics):
        found += [p.strip() for p in topics[name].split("\n\n") if len(p.strip()) >= 40]
    return found[: args.documents] if args.documents else found


def build_tokenizer(folder: Path, texts: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2048, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tokenizer.save_pretrained(folder)


def build_base(folder: Path, vocab_size: int, eos: int) -> None:
    """The "pretrained" model: a small Llama, written by transformers with a fixed seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, tie_word_embeddings=False,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)


def lora_config() -> Any:
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0)


cache = Path(args.cache)
texts = paragraphs()
with exclusive(cache):
    if not (cache / "tokenizer" / "tokenizer.json").exists():
        build_tokenizer(cache / "tokenizer", texts)
    from transformers import AutoConfig, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(cache / "tokenizer")
    if not (cache / "base" / "model.safetensors").exists():
        build_base(cache / "base", len(tokenizer), tokenizer.eos_token_id)

# -- 2. The data set: documents, tokenised, packed into rows with position ids restarting per document ------
import datasets  # noqa: E402

datasets.disable_progress_bars()


def packed(texts: list[str]) -> datasets.Dataset:
    documents = datasets.Dataset.from_dict({"text": texts})
    tokens = documents.map(
        lambda batch: {"input_ids": [t + [tokenizer.eos_token_id] for t in tokenizer(batch["text"])["input_ids"]]},
        batched=True, remove_columns=["text"],
    )  # fmt: skip
    rows = tokens.map(pack, batched=True, batch_size=1000, fn_kwargs={"seq_len": args.seq_len})
    return rows.with_format("torch")


split = datasets.Dataset.from_dict({"text": texts}).train_test_split(test_size=0.1, seed=0)
train_rows, held_out_rows = packed(split["train"]["text"]), packed(split["test"]["text"])

# -- 3. EPL: the layout, the model built on meta, the pretrained weights loaded ------------------------------
base_config = AutoConfig.from_pretrained(cache / "base")
# No key-value cache while training: with one, transformers' Llama ignores restarting position ids and lets
# attention cross the documents of a packed row (transformers 5.23 detects packing only without a cache).
base_config.use_cache = False
config = dict(LAYOUTS[args.layout])
if args.layout in PIPELINED:
    config["pipeline.num_stages"] = args.stages
config.update(json.loads(args.config))
epl.init(epl.Config(config))
degree = SPLIT.get(args.layout, 1) or epl.Env.get().cluster.world_size

from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: E402

# Built on meta: no memory until each rank gives values to its own part (docs/giant-models.md), from the model's
# own init (PEFT's for the adapters: lora_B = 0), drawn from the job's seed.
torch.manual_seed(0)
with torch.device("meta"), epl.split(degree) if degree > 1 else contextlib.nullcontext():
    model: torch.nn.Module = LlamaForCausalLM(base_config)
    if args.lora:  # inside the split scope: the adapters are part of the same TaskGraph
        from peft import get_peft_model

        model = get_peft_model(model, lora_config())  # the base frozen, adapters on the attention projections

lr = args.lr if args.lr is not None else (1e-2 if args.lora else 3e-3)
engine = epl.parallelize(model, optimizer=lambda params: torch.optim.AdamW(params, lr=lr))
engine.load_pretrained(cache / "base")  # each rank reads its stage's tensors and its shards' slices (PEFT: base_layer)
say(f"finetune: {args.layout} layout, {'LoRA adapters' if args.lora else 'every weight'} trained; "
    f"{len(train_rows)} training rows and {len(held_out_rows)} held-out rows of {args.seq_len} tokens")  # fmt: skip
for line in layout(engine):
    say(f"layout: {line}")

# -- 4. Train, evaluate every N steps, export --------------------------------------------------------------
loader = epl.io.data_loader(train_rows, args.batch_size, engine, drop_last=True, seed=0)
held_out = epl.io.data_loader(held_out_rows, args.batch_size, engine, shuffle=False, drop_last=True)


def evaluate() -> float:
    engine.eval()
    losses = [float(engine.evaluate(batch)) for _, batch in zip(range(args.eval_batches), held_out, strict=False)]
    engine.train()
    mean = torch.tensor(sum(losses) / len(losses), dtype=torch.float64)  # this replica's held-out share
    env = epl.Env.get()
    if env.cluster.world_size > 1:  # every rank holds its replica's loss: the mean over ranks is over replicas
        env.communicator.all_reduce(mean).wait()
        mean /= env.cluster.world_size
    return float(mean)


def report(step: int) -> None:
    loss = evaluate()  # every rank takes part
    say(f"eval  step {step:3d}: held-out loss {loss:.4f}, perplexity {math.exp(loss):.1f}")


report(0)
started = time.perf_counter()
progress = epl.Progress(engine, total=args.steps)
step, epoch = 0, 0
while step < args.steps:
    loader.sampler.set_epoch(epoch)
    for batch in loader:
        step += 1
        progress.update(engine.step(batch))
        if step % args.eval_every == 0 or step == args.steps:
            report(step)
        if step == args.steps:
            break
    epoch += 1
progress.close()
seconds = time.perf_counter() - started

out = Path(args.out)
engine.save_pretrained(out, merged=args.merged)  # every rank writes its pieces; a PeftModel: its adapters
say(f"trained {args.steps} steps in {seconds:.1f} s; exported to {out}")

# -- 5. The export in plain transformers: load it with the tokenizer and generate ---------------------------
if is_rank0():
    tokenizer.save_pretrained(out)  # beside the weights (save_pretrained keeps other files)
    if args.lora and not args.merged:  # adapter_config.json, adapter_model.safetensors: PEFT puts them on the base
        from peft import PeftModel

        finetuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(cache / "base"), out)
    else:
        finetuned = AutoModelForCausalLM.from_pretrained(out)  # plain transformers
    finetuned.config.use_cache = True  # generating: keys and values cached (the export says False, as trained)
    prompt = tokenizer(args.generate, return_tensors="pt")
    with torch.no_grad():
        made = finetuned.generate(**prompt, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    say(f"generate: {tokenizer.decode(made[0])!r}")
