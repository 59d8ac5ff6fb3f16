"""PEFT's LoRA on a pretrained base: the base folder loaded into the wrapped model, and the adapters (or the merged
model) exported for PEFT and transformers.

The base is a tiny Llama with random weights written by transformers' own ``save_pretrained``; nothing is
downloaded. Each layout builds the model on meta, wraps it with ``get_peft_model``, loads the base folder and
trains; the reference is ``from_pretrained`` plus ``get_peft_model`` in one process, given the engine's initial
``lora_A`` (PEFT's distribution, EPL's draw of it: a meta-built model takes its values from a stream per init unit).
"""

from __future__ import annotations

import json
import logging
import math
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch

import epl
from tests.helpers.distributed import run_ranks
from tests.materialize import models

TOLERANCE = 1e-10
EXPORT_TOLERANCE = 1e-5
#: transformers computes its causal-LM loss in float32; a pipeline averages it over micro-batches.
LOSS_TOLERANCE = 1e-6
TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
STEPS = 3
#: Two pipeline stages cut at a named point (the automatic cut of a PeftModel is another matter).
STAGES = {"pipeline.num_micro_batch": 2, "pipeline.split_points": ["base_model.model.model.layers.2"]}
#: The layouts: split(2), 2 pipeline stages and ZeRO v2 on 2 processes, and 3D (split(2) x 2 stages) on 4.
LAYOUTS: dict[str, dict[str, Any]] = {
    "split": {"config": {}, "split": 2, "ranks": 2},
    "pipeline": {"config": STAGES, "split": 1, "ranks": 2},
    "3d": {"config": STAGES, "split": 2, "ranks": 4},
    "zero v2": {"config": {"zero.level": "v2"}, "split": 1, "ranks": 2},  # 2 replicas, each fed the same rows
}


def lora() -> Any:
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0)


def tokens(step: int) -> torch.Tensor:
    return torch.randint(0, models.VOCABULARY, (4, models.SEQUENCE), generator=torch.Generator().manual_seed(step))


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def plain(value: torch.Tensor) -> torch.Tensor:
    from epl.sharding.chunks import held

    local = value.to_local() if hasattr(value, "to_local") else value
    return local.detach().clone(), held(value)  # type: ignore[return-value]


def run_layout(folder: str, out: str, layout: str) -> dict[str, Any]:
    """One rank: meta, get_peft_model, load the base, record the initial state, train, export both ways."""
    from peft import get_peft_model

    case = LAYOUTS[layout]
    torch.manual_seed(0)
    epl.init(epl.Config(case["config"]))
    with epl.split(case["split"]) if case["split"] > 1 else nullcontext():
        with torch.device("meta"):
            base = models.llama(tied=False).double()
        # In the split scope, outside the meta block: on meta, PEFT leaves the adapters float32 (it casts an
        # adapter to its base layer's dtype only off meta).
        model = get_peft_model(base, lora())
    engine = epl.parallelize(model, optimizer=adamw)
    engine.load_pretrained(folder)
    initial = {name: plain(value) for name, value in engine.model.state_dict(keep_vars=True).items()}
    losses = [float(engine.step({"input_ids": tokens(s), "labels": tokens(s)})) for s in range(STEPS)]
    engine.save_pretrained(f"{out}/adapter")
    engine.save_pretrained(f"{out}/merged", merged=True)
    return {"initial": initial, "losses": losses, "epl": epl.__file__}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(5)
    model = models.llama(tied=False).double()
    folder = tmp_path_factory.mktemp("peft") / "base"
    model.save_pretrained(folder)
    return folder


def whole(pieces: list[tuple[torch.Tensor, Any]]) -> torch.Tensor:
    """The whole tensor from the ranks' (local value, piece)."""
    first = pieces[0][1]
    out = torch.full(tuple(first.shape), float("nan"), dtype=pieces[0][0].dtype)
    for value, piece in pieces:
        for block in piece.blocks:
            out[tuple(slice(o, o + s) for o, s in zip(block.offsets, block.sizes, strict=True))] = block.in_local(value)
    return out


def reference(folder: Path, initial: dict[str, torch.Tensor]) -> torch.nn.Module:
    """from_pretrained + get_peft_model in one process, with the engine's initial lora_A."""
    from peft import get_peft_model
    from transformers import LlamaForCausalLM

    model = get_peft_model(LlamaForCausalLM.from_pretrained(folder, dtype=torch.float64), lora())
    state = model.state_dict()
    for name, value in state.items():
        if "lora_A" in name:
            value.data.copy_(initial[name])
    return model


def trained_here(model: torch.nn.Module) -> list[float]:
    optimizer = adamw([p for p in model.parameters() if p.requires_grad])
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = model(input_ids=tokens(step), labels=tokens(step)).loss
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_meta_peft_load_train_and_export(base: Path, tmp_path: Path, layout: str) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    results = run_ranks(run_layout, LAYOUTS[layout]["ranks"], str(base), str(tmp_path), layout, timeout=500)
    names = {name for result in results for name in result["initial"]}
    initial = {name: whole([r["initial"][name] for r in results if name in r["initial"]]) for name in names}
    model = reference(base, initial)
    expected_initial = model.state_dict()
    assert set(initial) == set(expected_initial)
    for name, value in expected_initial.items():  # the base loaded, lora_B zeros, lora_A PEFT's distribution
        torch.testing.assert_close(initial[name], value, rtol=0, atol=0, msg=name)
        if "lora_B" in name:
            assert not value.any(), name
        if "lora_A" in name:
            assert value.abs().max() <= 1 / math.sqrt(value.shape[1]) and value.std() > 0, name
    expected = trained_here(model)
    for result in results:
        assert Path(result["epl"]).resolve() == Path(epl.__file__).resolve()
        torch.testing.assert_close(result["losses"], expected, rtol=LOSS_TOLERANCE, atol=LOSS_TOLERANCE)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=tokens(9)).logits
        untrained = LlamaForCausalLM.from_pretrained(base, dtype=torch.float64)(input_ids=tokens(9)).logits
        assert (logits - untrained).abs().max() > 1e-3  # the adapters trained: the exports carry them
        config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
        assert config["peft_type"] == "LORA" and not (tmp_path / "adapter" / "model.safetensors").exists()
        adapted = PeftModel.from_pretrained(
            LlamaForCausalLM.from_pretrained(base, dtype=torch.float64), tmp_path / "adapter"
        )
        torch.testing.assert_close(
            adapted(input_ids=tokens(9)).logits, logits, rtol=EXPORT_TOLERANCE, atol=EXPORT_TOLERANCE
        )
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float64)
        assert type(merged) is LlamaForCausalLM
        torch.testing.assert_close(
            merged(input_ids=tokens(9)).logits, logits, rtol=EXPORT_TOLERANCE, atol=EXPORT_TOLERANCE
        )


@pytest.mark.parametrize("meta", ["torch.device", "model.meta_init"])
def test_one_process_meta_peft_loads_the_base_and_starts_as_peft(base: Path, meta: str) -> None:
    """Both ways of building on meta: every base weight loaded (names without PEFT's wrappers), lora_B zeros and
    lora_A PEFT's distribution: the adapted model starts as the base."""
    from peft import get_peft_model
    from transformers import LlamaForCausalLM

    epl.init(epl.Config({"model.meta_init": meta == "model.meta_init"}))
    with torch.device("meta") if meta == "torch.device" else nullcontext():
        base_model = models.llama(tied=False).double()
    model = get_peft_model(base_model, lora())
    assert model.base_model.model.model.layers[0].self_attn.q_proj.lora_A.default.weight.is_meta
    engine = epl.parallelize(model)
    engine.load_pretrained(base)
    for name, value in engine.model.state_dict().items():
        if "lora_B" in name:
            assert not value.any(), name
        if "lora_A" in name:
            assert value.abs().max() <= 1 / math.sqrt(value.shape[1]) and value.std() > 0, name
    plain_base = LlamaForCausalLM.from_pretrained(base, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(
            engine.model(input_ids=tokens(1)).logits, plain_base(input_ids=tokens(1)).logits, rtol=0, atol=0
        )


def test_inits_from_the_base_weights_are_refused_on_meta() -> None:
    """DoRA computes its magnitudes from base weights a meta model does not have yet: refused, naming the layer.
    (PiSSA, OLoRA and the other inits from the base's values already fail in get_peft_model on meta.)"""
    from peft import LoraConfig, get_peft_model

    epl.init()
    with torch.device("meta"):
        model = get_peft_model(
            models.llama(tied=False).double(), LoraConfig(r=4, target_modules=["q_proj"], use_dora=True)
        )
    with pytest.raises(epl.UninitializedError, match="use_dora=True"):
        epl.parallelize(model)


def test_strict_false_logs_what_it_did_not_load(base: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "partial"
    folder.mkdir()
    tensors = load_file(base / "model.safetensors")
    dropped = sorted(name for name in tensors if ".layers.1." in name)
    save_file({k: v for k, v in tensors.items() if k not in dropped}, folder / "model.safetensors")
    from peft import get_peft_model

    epl.init()
    with torch.device("meta"):
        model = get_peft_model(models.llama(tied=False).double(), lora())
    engine = epl.parallelize(model)
    with pytest.raises(epl.EplError, match="missing.*keep their initial"):
        engine.load_pretrained(folder)
    for _ in range(2):  # on every use, not once per process
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="epl.pretrained.loading"):
            engine.load_pretrained(folder, strict=False)
        (record,) = [r for r in caplog.records if "did not load" in r.getMessage()]
        assert f"did not load {len(dropped)} of the model's tensors" in record.getMessage()
        assert "layers.1.self_attn.q_proj.base_layer.weight" in record.getMessage()


class Wrapper(torch.nn.Module):
    """A module of the user's own around a transformers model, holding its config."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def forward(self, **batch: Any) -> Any:
        return self.inner(**batch)


def test_an_export_transformers_cannot_read_is_refused(tmp_path: Path) -> None:
    """Names that are not the config's architecture's would load as a random model: refused, nothing written. A
    PEFT model writes its adapters (PEFT's names under PEFT's config), never its names under the base's config."""
    from peft import get_peft_model

    epl.init()
    engine = epl.parallelize(Wrapper(models.llama(tied=False).double()))
    with pytest.raises(epl.EplError, match="transformers would load a random model"):
        engine.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(epl.EplError, match="merged=True merges a PEFT model's adapters"):
        engine.save_pretrained(tmp_path / "out", merged=True)
    engine = epl.parallelize(get_peft_model(models.llama(tied=False).double(), lora()))
    engine.save_pretrained(tmp_path / "peft")
    assert sorted(p.name for p in (tmp_path / "peft").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]


def test_merging_into_a_tied_weight_is_refused(tmp_path: Path) -> None:
    """LoRA on a head tied to the embedding: a merged head would be tied back to the embedding by transformers."""
    from peft import LoraConfig, get_peft_model

    epl.init()
    model = get_peft_model(models.llama(tied=True).double(), LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    engine = epl.parallelize(model)
    with pytest.raises(epl.EplError, match=r"lm_head.weight' is tied to \['model.embed_tokens.weight'\]"):
        engine.save_pretrained(tmp_path / "merged", merged=True)
    assert not (tmp_path / "merged").exists()


def test_adapters_saved_beside_a_model_keep_it(base: Path, tmp_path: Path) -> None:
    """An adapter export owns only PEFT's two files: a model folder it is written into keeps its weights."""
    import shutil

    from peft import get_peft_model

    folder = tmp_path / "model"
    shutil.copytree(base, folder)
    before = sorted(p.name for p in folder.iterdir())
    epl.init()
    engine = epl.parallelize(get_peft_model(models.llama(tied=False).double(), lora()))
    engine.save_pretrained(folder)
    after = sorted(p.name for p in folder.iterdir())
    assert after == sorted([*before, "adapter_config.json", "adapter_model.safetensors"])


def test_modules_to_save_load_from_the_base_and_export_trained(base: Path, tmp_path: Path) -> None:
    """``modules_to_save=["lm_head"]``: the original and its trainable copy both read the base's ``lm_head.weight``
    (as PEFT copies it); the adapter export holds the trained copy, the merged export writes it as ``lm_head``."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    def config() -> Any:
        return LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])

    epl.init()
    with torch.device("meta"):
        base_model = models.llama(tied=False).double()
    engine = epl.parallelize(get_peft_model(base_model, config()), optimizer=adamw)
    engine.load_pretrained(base)
    expected = get_peft_model(LlamaForCausalLM.from_pretrained(base, dtype=torch.float64), config()).state_dict()
    for name, value in engine.model.state_dict().items():
        if "lora_A" not in name:
            torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    for step in range(2):
        engine.step({"input_ids": tokens(step), "labels": tokens(step)})
    engine.save_pretrained(tmp_path / "adapter")
    engine.save_pretrained(tmp_path / "merged", merged=True)
    engine.model.eval()
    with torch.no_grad():
        logits = engine.model(input_ids=tokens(9)).logits
        adapted = PeftModel.from_pretrained(
            LlamaForCausalLM.from_pretrained(base, dtype=torch.float64), tmp_path / "adapter"
        )
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float64)
        for back in (adapted, merged):
            torch.testing.assert_close(
                back(input_ids=tokens(9)).logits, logits, rtol=EXPORT_TOLERANCE, atol=EXPORT_TOLERANCE
            )
