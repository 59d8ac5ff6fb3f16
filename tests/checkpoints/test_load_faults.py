"""Damaged checkpoints fail the same way on every rank: one ``EplError`` naming the file, within seconds, and an
intact checkpoint then loads.

For ``engine.load`` and ``engine.load_pretrained`` under data parallelism, split(2) and a 2-stage pipeline (2
processes each): truncated, bit-flipped and missing files, a damaged safetensors header and a bad index. A rank
often reads a damaged file alone (a pipeline stage reads its own tensors; each rank checks its share of a
checkpoint's checksums): every rank must still raise, none may wait for the others until
``communication.timeout``, nothing may be applied, and the script's fallback (``except epl.EplError: load the
intact one``) must load the saved weights on every rank. Every case of a layout runs in one launch.
"""

from __future__ import annotations

import json
import shutil
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import epl
from tests.checkpoints.test_layouts import LAYOUTS as CHECKPOINT_LAYOUTS
from tests.checkpoints.test_layouts import Net, step
from tests.helpers.distributed import run_ranks
from tests.materialize import models

#: A rank that waited for another would wait this long (communication.timeout); an agreed error takes a second.
TIMEOUT = 60
#: What "within seconds" means here (2 processes sharing 2 busy cores).
QUICK = 20.0
PIPELINE = {"pipeline.num_micro_batch": 2, "auto.auto_parallel": True, "pipeline.num_stages": 2}
#: For each layout: the checkpoint layout of tests.checkpoints.test_layouts, the load_pretrained config and split.
LAYOUTS = {
    "data parallel": ("data parallel", {}, 1),
    "split": ("split", {}, 2),
    "pipeline": ("pipeline 2x2", PIPELINE, 1),
}


# -- faults -------------------------------------------------------------------------------------------------------
def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def damaged_checkpoints(intact: Path) -> dict[str, tuple[Path, str]]:
    """Copies of the checkpoint ``intact``, each damaged one way: case -> (folder, the file to be named)."""
    data = sorted(intact.glob("*.distcp"))
    assert len(data) == 2, data  # one file per rank: each rank reads the other's too, or not at all
    faults = {
        "truncated file": (data[1].name, truncate),
        "bit-flipped file": (data[0].name, lambda path: flip(path, path.stat().st_size // 2)),
        "missing file": (data[1].name, Path.unlink),
        "truncated metadata": (".metadata", truncate),
    }
    cases = {}
    for case, (name, fault) in faults.items():
        folder = intact.with_name(f"{intact.name}-{case.replace(' ', '-')}")
        shutil.copytree(intact, folder)
        fault(folder / name)
        cases[case] = (folder, name)
    return cases


def damaged_pretrained(intact: Path, alone: str) -> dict[str, tuple[Path, str]]:
    """Copies of transformers' folder ``intact`` (several files and an index), each damaged one way: case ->
    (folder, the file to be named). ``alone``: a shard only the pipeline's last stage reads."""
    index = json.loads((intact / "model.safetensors.index.json").read_text())
    other = index["weight_map"]["model.embed_tokens.weight"]

    def bad_index(path: Path) -> None:
        path.write_text(path.read_text()[:-20])

    def names_missing(path: Path) -> None:
        broken = json.loads(path.read_text())
        broken["weight_map"]["model.norm.weight"] = "model-00099-of-00099.safetensors"
        path.write_text(json.dumps(broken))

    faults = {
        "truncated shard": (alone, truncate),
        "bit-flipped header": (other, lambda path: flip(path, 8)),  # the header's first byte: not JSON
        "corrupt header of a shard one stage reads": (alone, lambda path: flip(path, 12)),
        "missing shard": (alone, Path.unlink),
        "bad index json": ("model.safetensors.index.json", bad_index),
        "index naming a missing shard": ("model.safetensors.index.json", names_missing),
    }
    cases = {}
    for case, (name, fault) in faults.items():
        folder = intact.with_name(f"{intact.name}-{case.replace(' ', '-')}")
        shutil.copytree(intact, folder)
        fault(folder / name)
        cases[case] = (folder, "model-00099-of-00099.safetensors" if case.startswith("index naming") else name)
    return cases


# -- one rank -----------------------------------------------------------------------------------------------------
def checkpoint_engine(layout: str) -> epl.Engine:
    """test_layouts' engine of ``layout`` (its Net, seed and optimizer), with the short timeout."""
    options = CHECKPOINT_LAYOUTS[layout]
    epl.init(epl.Config({**options.get("config", {}), "communication.timeout": TIMEOUT}))
    torch.manual_seed(0)
    with epl.split(2) if options.get("split") else nullcontext():
        model = Net(options.get("stages", "")).double()
    return epl.parallelize(model, optimizer=lambda p: torch.optim.AdamW(p, lr=0.01), loss_fn=nn.MSELoss())


def pretrained_engine(config: dict[str, Any], split: int) -> epl.Engine:
    """The Llama of tests.materialize built on meta, under ``config`` and ``split``."""
    torch.manual_seed(1)
    epl.init(epl.Config({**config, "communication.timeout": TIMEOUT}))
    with torch.device("meta"), epl.split(split) if split > 1 else nullcontext():
        model = models.llama(tied=True).double()
    return epl.parallelize(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.5))


def whole(engine: epl.Engine) -> dict[str, torch.Tensor]:
    return {key: value.detach().clone() for key, value in engine.state_dict(full=True)["model"].items()}


def disturb(engine: epl.Engine) -> None:
    """Change every weight, so that a fallback load shows it loaded and a refused load that it applied nothing."""
    with torch.no_grad():
        for parameter in engine.model.parameters():
            parameter.add_(1.0)


def attempts(engine: epl.Engine, load: Any, cases: dict[str, tuple[str, str]], intact: str) -> dict[str, Any]:
    """Each damaged case loaded, caught, and followed by the fallback load of ``intact``: what this rank saw."""
    results = {}
    for case, (folder, name) in cases.items():
        disturb(engine)
        before = whole(engine)
        start = time.perf_counter()
        try:
            load(folder)
            outcome: dict[str, Any] = {"error": None, "message": "loaded"}
        except epl.EplError as error:
            outcome = {"error": type(error).__name__, "message": str(error)}
        outcome["seconds"], outcome["file"] = time.perf_counter() - start, name
        after = whole(engine)
        outcome["unchanged"] = all(torch.equal(after[key], value) for key, value in before.items())
        load(intact)  # the script's fallback
        outcome["fallback"] = whole(engine)
        outcome["global_step"] = engine.global_step
        results[case] = outcome
    return results


def faults_of_one_layout(layout: str, root: str, pretrained: str, cases: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """One rank: ``engine.load`` of every damaged copy of a checkpoint its layout saved (2 files), then
    ``load_pretrained`` of every damaged copy of transformers' folder, each followed by the fallback."""
    import torch.distributed as dist

    checkpoint_layout, config, split = LAYOUTS[layout]
    engine = checkpoint_engine(checkpoint_layout)
    step(engine, 0)
    intact = Path(root) / "intact"
    engine.save(intact)
    saved = whole(engine)
    if dist.get_rank() == 0:
        damaged = {case: (str(folder), name) for case, (folder, name) in damaged_checkpoints(intact).items()}
        (Path(root) / "cases.json").write_text(json.dumps(damaged))
    dist.barrier()
    damaged = json.loads((Path(root) / "cases.json").read_text())
    engine = checkpoint_engine(checkpoint_layout)
    loads = attempts(engine, engine.load, damaged, str(intact))
    engine = pretrained_engine(config, split)
    loads_pretrained = attempts(engine, engine.load_pretrained, cases, pretrained)
    return {"saved": saved, "load": loads, "load_pretrained": loads_pretrained}


# -- the tests ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module, dict[str, tuple[str, str]]]:
    """A Llama saved by transformers in several files, the model, and the damaged copies of the folder."""
    torch.manual_seed(5)
    model = models.llama(tied=True).double()
    folder = tmp_path_factory.mktemp("pretrained") / "llama"
    model.save_pretrained(folder, max_shard_size="40KB")
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    alone = weight_map["model.layers.3.mlp.down_proj.weight"]
    held = [name for name, file in weight_map.items() if file == alone]
    assert all(name.startswith(("model.layers.3.", "model.norm")) for name in held), held  # the last stage's
    cases = {case: (str(path), name) for case, (path, name) in damaged_pretrained(folder, alone).items()}
    return folder, model, cases


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_rank_names_the_damaged_file_at_once_and_the_fallback_loads(
    layout: str, pretrained: tuple[Path, torch.nn.Module, dict[str, tuple[str, str]]], tmp_path: Path
) -> None:
    folder, model, cases = pretrained
    results = run_ranks(faults_of_one_layout, 2, layout, str(tmp_path), str(folder), cases, timeout=240)
    expected_pretrained = {key: value.detach() for key, value in model.state_dict().items()}
    for rank, result in enumerate(results):
        for kind, expected, step_after in (
            ("load", result["saved"], 1),
            ("load_pretrained", expected_pretrained, None),
        ):
            assert len(result[kind]) == (4 if kind == "load" else len(cases))
            for case, outcome in result[kind].items():
                where = f"{layout}, {kind}, {case}, rank {rank}: {outcome['message']}"
                assert outcome["error"] == "EplError", where
                assert outcome["file"] in outcome["message"], where
                assert outcome["seconds"] < QUICK, (outcome["seconds"], where)
                assert outcome["unchanged"], where  # nothing was applied
                assert outcome["fallback"], where
                for key, value in outcome["fallback"].items():
                    assert torch.equal(value, expected[key]), (key, where)
                if step_after is not None:
                    assert outcome["global_step"] == step_after, where
    if layout == "pipeline":  # the last stage alone reads that shard: the first learns of it by the agreement
        for case in ("truncated shard", "corrupt header of a shard one stage reads"):
            first, last = (result["load_pretrained"][case]["message"] for result in results)
            assert first.startswith("Rank 1 refused the checkpoint: Cannot read the checkpoint file"), first
            assert last.startswith("Cannot read the checkpoint file"), last


def test_a_file_that_cannot_be_read_is_named_in_one_process(tmp_path: Path) -> None:
    """DCP wraps a reader's error in its CheckpointException, a BaseException that ``except Exception`` misses and
    that names no file; and safetensors' errors name none either. Here the checksums are rewritten after the damage
    (so only reading can find it), and a single-file folder has a broken header: both are EplErrors naming the
    file, and the intact files then load."""
    from tests.checkpoints.test_safety import rewrite_checksums

    engine = checkpoint_engine("local")
    step(engine, 0)
    engine.save(tmp_path / "intact")
    engine.save_pretrained(tmp_path / "pretrained")
    saved = whole(engine)
    damaged = tmp_path / "damaged"
    shutil.copytree(tmp_path / "intact", damaged)
    data = next(damaged.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:4000])  # into the model's tensors (the first), which both loads read
    rewrite_checksums(damaged)
    for load in (engine.load, epl.read_model_state):
        with pytest.raises(epl.EplError, match=rf"Cannot read the checkpoint file {data}"):
            load(damaged)
    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "pretrained", broken)
    flip(broken / "model.safetensors", 8)
    disturb(engine)
    with pytest.raises(epl.EplError, match=r"Cannot read the checkpoint file .*broken/model.safetensors"):
        engine.load_pretrained(broken)
    engine.load_pretrained(tmp_path / "pretrained")
    assert all(torch.equal(value, saved[key]) for key, value in whole(engine).items())
