"""Giant models (docs/giant-models.md): meta construction, ``load_pretrained`` and ``save_pretrained`` against
PyTorch's own ways, transformers' Llama under ``epl.split(2)`` on 2 processes, in the same run.

**The model.** transformers' ``LlamaForCausalLM``, unmodified, float32, its head not tied (so that torch's DCP
reads the folder as it is): hidden 1024, 16 layers, 16 attention heads over 8 key/value heads, SwiGLU MLP of
2816, vocabulary 32000; 252M parameters, 0.94 GiB (short mode: hidden 256, 2 layers, vocabulary 4096).

**Construction.** ``with torch.device("meta"), epl.split(2): model = ...`` then ``epl.parallelize`` (each rank
initialises its shards, a layer at a time) against the same without ``torch.device("meta")`` (every rank builds
the whole model, then keeps its shards: EPL's path before meta construction). Fresh processes for each run, so
that each peak is its own; the time and the peak resident memory over what the process held before, per rank.

**Loading.** ``engine.load_pretrained(folder)`` of a folder transformers' ``save_pretrained`` wrote, against
``torch.distributed.checkpoint.load`` with ``HuggingFaceStorageReader`` into the same model sharded by DTensor's
``parallelize_module`` with torchtitan's plan (built on meta, ``to_empty``). Both must hold the same shards
afterwards. Bytes read per rank are counted on both sides (the slices each asks safetensors for).

**Saving.** ``engine.save_pretrained(folder)`` (transformers' format, written in place by every rank) against
``dcp.save`` with ``HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True)`` (each rank
writes its shards, then rank 0 consolidates them into whole tensors). Both folders must hold the same tensors.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from tests.helpers.distributed import run_ranks

from benchmarks.harness import MIB, Ratio, ResultRow, Section, compare, record, short_mode
from benchmarks.test_split_llama import local, torchtitan_plan

if TYPE_CHECKING:
    from torch import nn

pytestmark = pytest.mark.multiprocess

FULL = {"hidden_size": 1024, "num_hidden_layers": 16, "intermediate_size": 2816, "vocab_size": 32000}
SHORT = {"hidden_size": 256, "num_hidden_layers": 2, "intermediate_size": 704, "vocab_size": 4096}
#: CI (short mode) only catches gross regressions; a full run checks the targets (<= 1.0) with margin for noise.
MAX_RATIO = 3.0 if short_mode() else 1.25
GIB = 2**30
CONSTRUCTION = Section(
    "Giant models: meta construction",
    __file__,
    "Seconds and peak resident memory per rank of building transformers' `LlamaForCausalLM` (untied, "
    f"hidden {FULL['hidden_size']}, {FULL['num_hidden_layers']} layers, vocabulary {FULL['vocab_size']}, float32) "
    "under `epl.split(2)` on the meta device and `epl.parallelize` (each rank initialises only its shards, a layer "
    "at a time), over building the whole model on every rank and parallelizing it (the path before meta "
    "construction), 2 processes, fresh processes for each run; the larger of the two ranks' figures.",
)
PRETRAINED = Section(
    "Giant models: transformers checkpoints read and written a slice per rank",
    __file__,
    "Seconds per call of `engine.load_pretrained` (each rank reads its shards' slices of a folder transformers "
    "wrote) over `torch.distributed.checkpoint.load` with `HuggingFaceStorageReader` into the same Llama sharded "
    "by DTensor with torchtitan's plan, and of `engine.save_pretrained` (transformers' format written in place "
    "by every rank) over `dcp.save` with `HuggingFaceStorageWriter(save_distributed=True, "
    "enable_consolidation=True)`; the same model as above on 2 processes under `epl.split(2)`, local disk, "
    "the larger of the two ranks' ratios. Target <= 1.0 for both. Bytes read per rank on both sides.",
)


def llama(shape: dict[str, int]) -> nn.Module:
    """transformers' Llama of ``shape`` (GQA with half as many key/value heads), untied, SDPA."""
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = shape["hidden_size"] // 64
    config = LlamaConfig(
        **shape, num_attention_heads=heads, num_key_value_heads=heads // 2, tie_word_embeddings=False,
        max_position_embeddings=256, attn_implementation="sdpa",
    )  # fmt: skip
    return LlamaForCausalLM(config)


def build(meta: bool, shape: dict[str, int]) -> dict[str, Any]:
    """On one rank of a fresh job: build the model (on meta or whole) under split(2) and parallelize it."""
    import time
    from contextlib import nullcontext

    import torch
    import transformers  # noqa: F401 - imported before the baseline, as a script's imports are

    import epl
    from benchmarks.resident import peak, reset_peak

    epl.init(epl.Config({}))
    torch.manual_seed(0)
    baseline = reset_peak()
    start = time.perf_counter()
    with torch.device("meta") if meta else nullcontext(), epl.split(2):
        model = llama(shape)
    engine = epl.parallelize(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    seconds = time.perf_counter() - start
    grown = peak() - baseline
    tokens = torch.randint(0, shape["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(1))
    loss = float(engine.step({"input_ids": tokens, "labels": tokens}))
    assert loss == loss, "the model built trains to a NaN loss"
    return {"seconds": seconds, "peak_growth": grown}


@pytest.mark.timeout(1200)
def test_meta_construction_against_building_whole() -> None:
    shape, rounds = (SHORT, 1) if short_mode() else (FULL, 3)
    runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
    for index in range(rounds):
        for meta in (True, False) if index % 2 == 0 else (False, True):
            ranks = run_ranks(build, 2, meta, shape, timeout=900)
            runs[meta].append({key: max(rank[key] for rank in ranks) for key in ("seconds", "peak_growth")})

    def median(meta: bool | int, key: str) -> float:
        values = sorted(run[key] for run in runs[meta])
        return values[len(values) // 2]

    size = 4 * parameters_of(shape)
    time_ratio = median(True, "seconds") / median(False, "seconds")
    memory_ratio = median(True, "peak_growth") / median(False, "peak_growth")
    meta, whole = (f"{median(m, 'seconds'):.2f} s, peak +{median(m, 'peak_growth') / MIB:.0f} MiB" for m in (1, 0))
    detail = f"model {size / GIB:.2f} GiB; per rank, meta: {meta}; whole: {whole} (median of {rounds} runs each)"
    row = ResultRow(
        "Meta construction + `parallelize`, Llama under `epl.split(2)`, 2 processes",
        "building whole, then sharding",
        time=(Ratio(time_ratio),),
        memory=(Ratio(memory_ratio, "peak"),),
        plot="meta construction vs whole",
    )
    record("meta_construction", [row], section=CONSTRUCTION, details=[detail])
    print("\n" + detail, f"time ratio {time_ratio:.3f}, memory ratio {memory_ratio:.3f}")
    if not short_mode():  # the short model (24 MiB) is smaller than what a process's first step allocates anyway
        assert median(True, "peak_growth") < 0.75 * median(False, "peak_growth"), runs
    assert time_ratio < MAX_RATIO, runs


def parameters_of(shape: dict[str, int]) -> int:
    """The Llama's parameter count, from its meta construction."""
    import torch

    with torch.device("meta"):
        return sum(p.numel() for p in llama(shape).parameters())


class _Counting:
    """Adds the bytes of every slice a ``HuggingFaceStorageReader`` reads to ``read``."""

    read = 0

    @classmethod
    def reader(cls, folder: str) -> Any:
        import math

        from torch.distributed.checkpoint import HuggingFaceStorageReader

        class CountingReader(HuggingFaceStorageReader):
            def read_data(self, plan: Any, planner: Any) -> Any:
                for item in plan.items:
                    itemsize = self.storage_data[item.storage_index].dtype.itemsize
                    cls.read += math.prod(item.lengths) * itemsize
                return super().read_data(plan, planner)

        return CountingReader(folder)


def race_checkpoints(folder: str, shape: dict[str, int], rounds: int) -> dict[str, Any]:
    """On one rank: load the folder both ways, check the shards agree, time loading and saving both ways."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import epl

    epl.init(epl.Config({}))
    rank = dist.get_rank()
    if rank == 0:
        torch.manual_seed(3)
        llama(shape).save_pretrained(f"{folder}/pretrained")
    dist.barrier()
    with torch.device("meta"), epl.split(2):
        ours = llama(shape)
    engine = epl.parallelize(ours, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    with torch.device("meta"):
        theirs = parallelize_module(llama(shape), init_device_mesh("cpu", (2,)), torchtitan_plan())
    theirs.to_empty(device="cpu")

    def torch_load() -> None:
        dcp.load(theirs.state_dict(), storage_reader=_Counting.reader(f"{folder}/pretrained"))

    def epl_load() -> int:
        return engine.load_pretrained(f"{folder}/pretrained")

    torch_load()
    epl_read, torch_read = epl_load(), _Counting.read
    theirs_by_name = dict(theirs.named_parameters())
    for name, param in engine.model.named_parameters():
        assert torch.equal(param, local(theirs_by_name[name])), f"EPL and DCP loaded different {name}"

    def clean() -> None:
        dist.barrier()
        if rank == 0:
            for side in ("epl", "torch"):
                shutil.rmtree(f"{folder}/{side}", ignore_errors=True)
        dist.barrier()

    def torch_save() -> None:
        writer = HuggingFaceStorageWriter(f"{folder}/torch", save_distributed=True, enable_consolidation=True)
        dcp.save(theirs.state_dict(), storage_writer=writer)

    def epl_save() -> None:
        engine.save_pretrained(f"{folder}/epl")

    clean()
    torch_save()
    epl_save()
    dist.barrier()
    if rank == 0:
        assert_same_tensors(Path(folder) / "epl", Path(folder) / "torch")
    loading = compare("load_pretrained", torch_load, epl_load, rounds=rounds, calls_per_round=1, warmup=0,
                      sync=dist.barrier, save=rank == 0)  # fmt: skip
    saving = compare("save_pretrained", torch_save, epl_save, rounds=rounds, calls_per_round=1, warmup=0,
                     sync=clean, save=rank == 0)  # fmt: skip
    return {
        "load": loading.ratio, "save": saving.ratio, "epl_read": epl_read, "torch_read": torch_read,
        "details": [loading.detail(), saving.detail()],
    }  # fmt: skip


def assert_same_tensors(ours: Path, theirs: Path) -> None:
    """The top-level safetensors files of the two folders hold the same names and values."""
    import torch
    from safetensors.torch import load_file

    def tensors(folder: Path) -> dict[str, torch.Tensor]:
        return {name: t for file in sorted(folder.glob("*.safetensors")) for name, t in load_file(file).items()}

    mine, other = tensors(ours), tensors(theirs)
    assert mine.keys() == other.keys(), sorted(mine.keys() ^ other.keys())
    for name, tensor in mine.items():
        assert torch.equal(tensor, other[name]), f"save_pretrained and HuggingFaceStorageWriter wrote different {name}"


@pytest.mark.timeout(1800)
def test_pretrained_checkpoints_against_dcp_hf_storage() -> None:
    shape, rounds = (SHORT, 2) if short_mode() else (FULL, 7)
    with tempfile.TemporaryDirectory(prefix="epl-bench-pretrained-") as folder:
        ranks = run_ranks(race_checkpoints, 2, folder, shape, rounds, timeout=1200)
        checkpoint = (Path(folder) / "pretrained" / "model.safetensors").stat().st_size
    rows = [
        ResultRow(
            "`engine.load_pretrained`, Llama under `epl.split(2)`, 2 processes",
            "`dcp.load` + `HuggingFaceStorageReader` into DTensor",
            time=(Ratio(max(rank["load"] for rank in ranks)),),
            plot="load_pretrained vs DCP HF reader",
        ),
        ResultRow(
            "`engine.save_pretrained`, Llama under `epl.split(2)`, 2 processes",
            "`dcp.save` + `HuggingFaceStorageWriter` with consolidation",
            time=(Ratio(max(rank["save"] for rank in ranks)),),
            plot="save_pretrained vs DCP HF writer",
        ),
    ]
    read = ", ".join(
        f"rank {i}: EPL {r['epl_read'] / MIB:.0f} MiB, DCP {r['torch_read'] / MIB:.0f} MiB" for i, r in enumerate(ranks)
    )
    details = [
        f"checkpoint {checkpoint / MIB:.0f} MiB; bytes read per rank: {read}",
        f"load (rank 0): {ranks[0]['details'][0]}",
        f"save (rank 0): {ranks[0]['details'][1]}",
        "ratios per rank: load " + ", ".join(f"{r['load']:.3f}" for r in ranks)
        + "; save " + ", ".join(f"{r['save']:.3f}" for r in ranks),
    ]  # fmt: skip
    record("pretrained", rows, section=PRETRAINED, details=details)
    print("\n" + "\n".join(details))
    for rank in ranks:
        assert rank["epl_read"] <= 0.6 * checkpoint, details
        assert rank["load"] < MAX_RATIO and rank["save"] < MAX_RATIO, details
