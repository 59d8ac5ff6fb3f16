"""transformers' checkpoint folders under 3D: each rank reads its slices, training equals one process, and what
``save_pretrained`` writes loads into plain transformers with the same logits.

The folder is written by transformers' own ``save_pretrained`` in several safetensors files (an index). The
model is built on meta under split(2) x 2 stages on 4 processes (Llama with its head tied to the embedding, so
the folder holds the embedding's name only).
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch

import epl
from tests.helpers.distributed import run_ranks
from tests.materialize import models

TOLERANCE = 1e-10
#: transformers computes its causal-LM loss in float32; a pipeline averages it over micro-batches.
LOSS_TOLERANCE = 1e-6
CONFIG = {"pipeline.num_micro_batch": 2, "auto.auto_parallel": True, "pipeline.num_stages": 2}


def tokens(step: int) -> torch.Tensor:
    return torch.randint(0, models.VOCABULARY, (4, models.SEQUENCE), generator=torch.Generator().manual_seed(step))


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5)


def train_from(folder: str, out: str, config: dict[str, Any], split: int, model_name: str = "llama") -> dict[str, Any]:
    """One rank: build on meta, load the folder, train 2 steps on the model's own loss, save_pretrained, and
    checkpoint with ``engine.save`` (at ``out``.ckpt)."""
    torch.manual_seed(0)
    epl.init(epl.Config(config))
    with torch.device("meta"), epl.split(split) if split > 1 else nullcontext():
        model = models.MODELS[model_name]().double()
    engine = epl.parallelize(model, optimizer=sgd)
    read = engine.load_pretrained(folder)
    losses = [float(engine.step({"input_ids": tokens(s), "labels": tokens(s)})) for s in range(2)]
    engine.save_pretrained(out, max_shard_size="40KB")
    engine.save(f"{out}.ckpt")
    return {"read": read, "losses": losses}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A Llama saved by transformers in several files, and the model itself."""
    torch.manual_seed(5)
    model = models.llama(tied=True).double()
    folder = tmp_path_factory.mktemp("pretrained") / "llama"
    model.save_pretrained(folder, max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").exists() and len(list(folder.glob("*.safetensors"))) > 3
    return folder, model


def trained_here(model: torch.nn.Module) -> list[float]:
    optimizer = sgd(model.parameters())
    losses = []
    for step in range(2):
        optimizer.zero_grad()
        loss = model(input_ids=tokens(step), labels=tokens(step)).loss
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_3d_reads_its_slices_trains_as_one_process_and_saves_for_transformers(
    pretrained: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    from transformers import LlamaForCausalLM

    folder, original = pretrained
    model = copy.deepcopy(original)
    out = tmp_path / "trained"
    results = run_ranks(train_from, 4, str(folder), str(out), CONFIG, 2, timeout=400)
    checkpoint_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    expected = trained_here(model)
    for result in results:
        assert result["read"] <= 0.35 * checkpoint_bytes
        torch.testing.assert_close(result["losses"], expected, rtol=LOSS_TOLERANCE, atol=LOSS_TOLERANCE)
    assert (out / "config.json").exists() and (out / "model.safetensors.index.json").exists()
    back = LlamaForCausalLM.from_pretrained(out, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(
            back(input_ids=tokens(9)).logits, model(input_ids=tokens(9)).logits, rtol=TOLERANCE, atol=TOLERANCE
        )


def test_one_process_loads_under_a_prefix_and_converts_dtypes(pretrained: tuple[Path, torch.nn.Module]) -> None:
    """The folder of a LlamaForCausalLM into the float32 LlamaModel inside it (names without ``model.``)."""
    from transformers import LlamaConfig, LlamaModel

    folder, model = pretrained
    epl.init()
    with torch.device("meta"):
        base = LlamaModel(LlamaConfig(**models.DECODER))
    engine = epl.parallelize(base)
    engine.load_pretrained(folder, strict=False)  # the folder's lm_head has no place in the base model
    assert engine.model.layers[0].mlp.up_proj.weight.dtype == torch.float32
    torch.testing.assert_close(
        engine.model.layers[0].mlp.up_proj.weight.detach(), model.model.layers[0].mlp.up_proj.weight.float()
    )


def test_a_folder_that_does_not_fit_is_refused_with_the_names(pretrained: tuple[Path, torch.nn.Module]) -> None:
    folder, _ = pretrained
    epl.init()
    engine = epl.parallelize(models.gpt2())
    with pytest.raises(epl.EplError, match=r"does not fit the model: missing \['transformer"):
        engine.load_pretrained(folder)


def test_pickled_checkpoints_are_refused(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    epl.init()
    engine = epl.parallelize(models.HandWritten())
    with pytest.raises(epl.EplError, match="pickle-based checkpoint.*safetensors"):
        engine.load_pretrained(tmp_path)


#: Two more layouts on 2 processes: ZeRO v2 over 2 replicas (each fed the same rows), and Mixtral's experts split
#: over the ranks from a folder in transformers' stored format (experts one by one, converted at load time). Each
#: run's ``engine.save`` checkpoint resumes in one process (another layout) as the model trained here.
TWO_PROCESS_CASES = {
    "llama zero v2": {"model": "llama", "config": {"zero.level": "v2"}, "split": 1},
    "mixtral split": {"model": "mixtral", "config": {}, "split": 2},
}


def train_cases(folders: dict[str, str], out: str) -> dict[str, dict[str, Any]]:
    return {
        name: train_from(folders[name], f"{out}/{name}", case["config"], case["split"], case["model"])
        for name, case in TWO_PROCESS_CASES.items()
    }


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_zero_v2_and_split_experts_load_train_as_one_process_and_save(tmp_path: Path) -> None:
    from safetensors import safe_open

    originals, folders = {}, {}
    for name, case in TWO_PROCESS_CASES.items():
        torch.manual_seed(5)
        originals[name] = models.MODELS[case["model"]]().double()
        folders[name] = str(tmp_path / name)
        originals[name].save_pretrained(folders[name])
    with safe_open(f"{folders['mixtral split']}/model.safetensors", framework="pt") as handle:
        assert any(".experts.0.w1.weight" in key for key in handle.keys())  # the stored format, not the model's
    results = run_ranks(train_cases, 2, folders, str(tmp_path / "out"), timeout=500)
    for name, case in TWO_PROCESS_CASES.items():
        model = copy.deepcopy(originals[name])
        expected = trained_here(model)
        size = sum(f.stat().st_size for f in Path(folders[name]).glob("*.safetensors"))
        for result in results:
            torch.testing.assert_close(result[name]["losses"], expected, rtol=LOSS_TOLERANCE, atol=LOSS_TOLERANCE)
            if case["split"] > 1:  # each rank reads its experts' tensors and its shards' slices
                assert result[name]["read"] < 0.75 * size, (name, result[name]["read"], size)
        resumed = _resumed_in_one_process(case["model"], tmp_path / "out" / f"{name}.ckpt")
        for key, value in model.state_dict().items():  # another layout (one process) resumes the trained model
            torch.testing.assert_close(resumed[key], value, rtol=LOSS_TOLERANCE, atol=LOSS_TOLERANCE, msg=key)
        back = type(model).from_pretrained(tmp_path / "out" / name, dtype=torch.float64, **_eager(model))
        with torch.no_grad():
            torch.testing.assert_close(
                back(input_ids=tokens(9)).logits, model(input_ids=tokens(9)).logits, rtol=TOLERANCE, atol=TOLERANCE
            )


def _resumed_in_one_process(model_name: str, checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model of the checkpoint a distributed run wrote with ``engine.save``, loaded by one process."""
    epl.init()
    engine = epl.parallelize(models.MODELS[model_name]().double(), optimizer=sgd)
    engine.load(str(checkpoint))
    return {key: value.detach().clone() for key, value in engine.model.state_dict().items()}


def _eager(model: torch.nn.Module) -> dict[str, str]:
    """The experts' implementation of ``model`` (the grouped kernels take no float64)."""
    implementation = getattr(model.config, "_experts_implementation", None)
    return {"experts_implementation": implementation} if implementation else {}
