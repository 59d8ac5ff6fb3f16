"""The fit check before launch (``epl.planner.fit_check``): ``epl.parallelize`` predicts the peak memory of the run's
most loaded device and warns (or refuses) when it does not fit, naming the largest term and the cheapest change
that fits; on CPU it runs only when asked, and it costs under 1% of ``epl.parallelize``."""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import epl
from epl.interfaces.cluster import Cluster
from epl.planner import PROFILES, Layout, Workload, fit_check
from epl.planner.estimate import RESERVED_BYTES
from tests.helpers.distributed import run_ranks

LOGGER = "epl.planner.fit_check"
#: A micro-batch that does not fit TIGHT (below) and one that does.
BIG = {"fit_check.micro_batch_size": 4, "fit_check.sequence_length": 4096}
SMALL = {"fit_check.micro_batch_size": 1, "fit_check.sequence_length": 64}


def llama(vocab: int = 1000, layers: int = 2, hidden: int = 64) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab)  # fmt: skip
    return LlamaForCausalLM(config)


def device(tmp_path: Path, mib: int) -> str:
    """A device profile file of ``mib`` MiB of memory besides what the runtime keeps."""
    path = tmp_path / f"tiny-{mib}.json"
    profile = {"base": "h100-sxm", "name": f"tiny-{mib}", "memory_bytes": RESERVED_BYTES + mib * 2**20}
    path.write_text(json.dumps(profile))
    return str(path)


def parallelize(model: nn.Module, config: dict[str, Any], optimizer: Any = None) -> epl.Engine:
    epl.init(epl.Config({"fit_check.enabled": True, **config}))
    return epl.parallelize(model, optimizer=optimizer or (lambda p: torch.optim.AdamW(p)))


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def terms_of(message: str) -> dict[str, float]:
    """The terms the message lists after ``all:``, in bytes."""
    found = re.search(r"; all: (.+?)\. Predicted", message)
    assert found is not None, message
    sizes = [re.fullmatch(r"(.+) ([\d.]+) (\w+)", item) for item in found.group(1).split(", ")]
    return {m.group(1): float(m.group(2)) * UNITS[m.group(3)] for m in sizes if m is not None}


def largest_of(message: str) -> tuple[str, float]:
    found = re.search(r"Largest term: (.+?) ([\d.]+) (\w+) \(", message)
    assert found is not None, message
    return found.group(1), float(found.group(2)) * UNITS[found.group(3)]


def change_of(message: str) -> dict[str, Any]:
    """The config keys of the message's cheapest change (``with zero.level: "v1", ...: 61.0 GiB of 80.0 GiB``)."""
    found = re.search(r"Cheapest change that fits: with (.+?)(?: \(micro-batches of (\d+)\))?: [\d.]+ \w+ of", message)
    assert found is not None, message
    keys = {}
    for item in found.group(1).split(", "):
        name, value = item.split(": ", 1)
        keys[name] = json.loads(value)
    if found.group(2):
        keys["fit_check.micro_batch_size"] = int(found.group(2))
    return keys


def test_a_run_that_does_not_fit_warns_once_with_its_largest_term_and_a_change_that_fits(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tight = {"fit_check.device": device(tmp_path, 256), **BIG}
    with caplog.at_level(logging.INFO, logger=LOGGER):
        engine = parallelize(llama(), tight)
    [warning] = warnings_of(caplog)
    assert engine.fit_check is None  # it ran at epl.parallelize
    assert re.search(r"predicted to peak at \d+\.\d MiB of 2\.2 GiB \(tiny-256, 2\.0 GiB of it kept", warning)
    assert largest_of(warning) == max(terms_of(warning).items(), key=lambda item: item[1])
    assert "micro-batches of 4 x 4096 tokens, fp32, AdamW" in warning
    assert 'fit_check.action: "refuse"' in warning and "fit_check.enabled: false" in warning
    change = change_of(warning)
    assert change, warning
    epl.Env.get().close()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        parallelize(llama(), {**tight, **change})  # the change named fits
    assert warnings_of(caplog) == []


def test_refuse_raises_the_same_text_before_the_first_step(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tight = {"fit_check.device": device(tmp_path, 256), **BIG}
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        parallelize(llama(), tight)
    [warning] = warnings_of(caplog)
    epl.Env.get().close()
    with pytest.raises(epl.EplError) as raised:
        parallelize(llama(), {**tight, "fit_check.action": "refuse"})
    assert str(raised.value) == warning


def test_a_run_that_fits_is_silent(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        engine = parallelize(llama(), {"fit_check.device": device(tmp_path, 256), **SMALL})
    assert caplog.records == [] and engine.fit_check is None


def test_on_cpu_it_runs_only_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def predicted(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the check ran")

    monkeypatch.setattr(fit_check, "estimate", predicted)
    monkeypatch.setattr(fit_check, "_plan_verdict", predicted)
    epl.init(epl.Config({"fit_check.device": device(tmp_path, 1), **BIG}))  # fit_check.enabled: "auto"
    engine = epl.parallelize(llama(), optimizer=lambda p: torch.optim.AdamW(p))
    assert engine.fit_check is None
    assert not fit_check.enabled("auto", torch.device("cpu"))
    assert fit_check.enabled("auto", torch.device("cuda", 0)) and fit_check.enabled(True, torch.device("cpu"))
    assert not fit_check.enabled(False, torch.device("cuda", 0))


def test_on_an_accelerator_it_runs_by_default_and_judges_the_most_loaded_stage() -> None:
    """A Plan of 2 pipeline stages x 2 replicas, made in one process (``epl.plan``), judged as a CUDA rank of it
    would judge it at ``epl.parallelize``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    epl.init(epl.Config({"pipeline.num_stages": 2, "auto.auto_parallel": True, "pipeline.num_micro_batch": 4,
                         "fit_check.device": "l40s", "fit_check.action": "refuse", "fit_check.micro_batch_size": 8,
                         "fit_check.sequence_length": 8192}))  # fmt: skip
    config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
                         num_key_value_heads=8, vocab_size=128256)  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    plan = epl.plan(model, world_size=4)
    rank = Cluster(world_size=4, rank=3, local_rank=3, local_world_size=4, device_type="cuda", device_index=3)
    env = epl.Env.get()
    with pytest.raises(epl.EplError, match=r"of stage [01] of 2, for micro-batches of 8 x 8192"):
        fit_check.before_launch(model, plan, [], env.config, rank, env.plugins, torch.optim.AdamW, own_loss=True)


def test_without_the_micro_batch_it_runs_at_the_first_step_on_its_batch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tokens = torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": tokens, "labels": tokens}
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        engine = parallelize(llama(), {"fit_check.device": device(tmp_path, 1), "fit_check.action": "refuse"})
        assert engine.fit_check is not None and caplog.records == []
        before = [p.detach().clone() for p in engine.parameters()]
        with pytest.raises(epl.EplError, match=r"micro-batches of 2 x 64 tokens") as raised:
            engine.step(batch)
    assert "Largest term: " in str(raised.value)
    assert engine.global_step == 0 and all(torch.equal(a, b) for a, b in zip(before, engine.parameters(), strict=True))
    epl.Env.get().close()
    with caplog.at_level(logging.WARNING, logger=LOGGER):  # warn: once, at the first step, which then trains
        engine = parallelize(llama(), {"fit_check.device": device(tmp_path, 1), "pipeline.num_micro_batch": 2})
        engine.step(batch)
        engine.step(batch)
    [warning] = warnings_of(caplog)
    assert "micro-batches of 1 x 64 tokens" in warning and engine.global_step == 2


def test_a_model_without_a_transformers_config_is_judged_by_the_plan_without_activations(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024))  # 8M parameters
    config = {"fit_check.device": device(tmp_path, 80), "fit_check.action": "refuse"}
    with pytest.raises(epl.EplError, match="activations not counted") as raised:
        parallelize(model, config, optimizer=lambda p: torch.optim.Adam(p))
    assert "Largest term: optimizer 64.0 MiB" in str(raised.value)
    assert "parameters 32.0 MiB, gradients 32.0 MiB" in str(raised.value)
    epl.Env.get().close()
    parallelize(model, config, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))  # 64 MiB of 80: fits


def test_the_changes_tried_are_one_setting_each_and_written_as_epl_keys() -> None:
    layout = Layout(data=2, tensor=2, pipeline=1, micro_batches=1, micro_batch_size=4)
    changed = fit_check.single_changes(layout, Workload(8, 1024))
    written = [fit_check.config_change(layout, c) for c in changed]
    assert written == [
        'zero.level: "v0"', 'zero.level: "v1"', 'zero.level: "v2"', 'gradient_checkpoint.type: "selective"',
        'gradient_checkpoint.type: "auto"',
        "pipeline.num_micro_batch: 4", "pipeline.num_micro_batch: 2", "split.sequence_parallel: true",
    ]  # fmt: skip
    alone = Layout(data=1, tensor=1, pipeline=1, micro_batches=1, micro_batch_size=1, gradient_checkpoint="full")
    assert fit_check.single_changes(alone, Workload(1, 1024)) == []


def test_the_device_is_the_accelerators_memory_with_the_closest_profiles_figures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    properties = SimpleNamespace(total_memory=79 * 2**30, name="NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: properties)
    found = fit_check.device_for(Cluster(device_type="cuda", device_index=0))
    assert found.memory_bytes == 79 * 2**30 and found.flops == PROFILES["h100-sxm"].flops
    assert found.name == "NVIDIA H100 80GB HBM3 (h100-sxm's figures)"
    properties.name = "Some Accelerator"  # unknown: the profile of the nearest memory (the first of 80 GiB)
    found = fit_check.device_for(Cluster(device_type="cuda", device_index=0))
    assert found.name == "Some Accelerator (a100-80gb's figures)" and found.memory_bytes == 79 * 2**30
    host = fit_check.device_for(Cluster(world_size=2, local_world_size=2, device_type="cpu"))
    assert 0 < host.memory_bytes < fit_check.device_for(Cluster(device_type="cpu")).memory_bytes


def test_a_device_that_is_no_profile_is_an_error_and_a_failing_prediction_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(epl.EplError, match="Unknown device 'h100-typo'"):
        parallelize(llama(), {"fit_check.device": "h100-typo", **SMALL})
    epl.Env.get().close()

    def fails(*args: Any, **kwargs: Any) -> None:
        raise ZeroDivisionError("a shape the formulas do not expect")

    monkeypatch.setattr(fit_check, "estimate", fails)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        engine = parallelize(llama(), {"fit_check.device": device(tmp_path, 1), **SMALL})
    assert engine is not None
    assert warnings_of(caplog) == [
        "Fit check skipped: it failed (ZeroDivisionError: a shape the formulas do not expect); the run goes on. "
        "Report it to EPL."
    ]


def test_the_check_costs_under_one_percent_of_parallelize_and_a_constant(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check's own time at ``epl.parallelize`` (the shape read, one estimate) against the whole call's, on a
    transformers Llama of 4 layers that fits: under 1% of it and 3 ms. One CPU process's ``epl.parallelize`` does
    little (about 2.5 ms here), so the constant dominates; docs/planner.md gives the figures in fresh processes, 1
    and 2 of them."""
    spent: list[float] = []
    original = fit_check.before_launch

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    monkeypatch.setattr(fit_check, "before_launch", timed)
    config = {"fit_check.device": "h100-sxm", "fit_check.micro_batch_size": 4, "fit_check.sequence_length": 1024}
    totals = []
    for _ in range(3):
        model = llama(vocab=32000, layers=4, hidden=256)
        start = time.perf_counter()
        parallelize(model, config)
        totals.append(time.perf_counter() - start)
        epl.Env.get().close()
    check, total = min(spent), min(totals)
    assert check < 0.01 * total + 0.003, (check, total)


def zero_is_the_change(profile: str, transformer: bool) -> str:
    """One rank of 2 data-parallel replicas that do not fit ``profile`` without ZeRO: the error it refuses with."""
    import torch

    import epl

    epl.init(epl.Config({"fit_check.enabled": True, "fit_check.device": profile, "fit_check.action": "refuse",
                         "fit_check.micro_batch_size": 1, "fit_check.sequence_length": 16}))  # fmt: skip
    model = llama(vocab=32000) if transformer else nn.Sequential(nn.Linear(1024, 4096), nn.Linear(4096, 1024))
    try:
        epl.parallelize(model, optimizer=lambda p: torch.optim.Adam(p))
    except epl.EplError as exc:
        return str(exc)
    return "fits"


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("transformer", [True, False], ids=["llama", "no config"])
def test_every_rank_refuses_alike_and_zero_is_named_where_it_fits(tmp_path: Path, transformer: bool) -> None:
    profile = device(tmp_path, 64 if transformer else 100)
    first, second = run_ranks(zero_is_the_change, 2, profile, transformer, timeout=240)
    assert first == second and 'Cheapest change that fits: with zero.level: "v' in first, first
