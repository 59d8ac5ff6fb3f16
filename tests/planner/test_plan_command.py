"""``epl plan --device ... [--auto] [--json]`` on a transformers Llama built on meta in the script."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner, Result

from epl.cli import make_cli

SCRIPT = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import epl

epl.init(epl.Config({"pipeline.num_stages": 2, "auto.auto_parallel": True, "pipeline.num_micro_batch": 8,
                     "zero.level": "v1"}))
config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256)
with torch.device("meta"), epl.split(8):
    model = LlamaForCausalLM(config)
epl.parallelize(model, optimizer=lambda p: torch.optim.AdamW(p))
"""
OPTIONS = ("plan", "-n", "64", "--gpu-per-worker", "8", "--device", "h100-sxm", "--global-batch-size", "64",
           "--sequence-length", "8192")  # fmt: skip


def run(*args: str) -> Result:
    return CliRunner().invoke(make_cli(), list(args))


def test_the_scripts_layout_gets_activations_time_and_mfu(tmp_path: Path) -> None:
    script = tmp_path / "llama8b.py"
    script.write_text(SCRIPT)
    result = run(*OPTIONS, "--json", str(script))
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    layout = plan["layout"]
    assert (layout["data"], layout["tensor"], layout["pipeline"], layout["micro_batches"]) == (4, 8, 2, 8)
    assert (layout["micro_batch_size"], layout["zero"], layout["schedule"]) == (2, "v1", "1F1B")
    assert plan["memory_per_device"]["activations"] > 0 and plan["fits"] is True
    assert 0 < plan["mfu"] < 1 and plan["placement"]["world_size"] == 64
    text = run(*OPTIONS, str(script)).output
    assert "tokens/s, MFU" in text and "bubble" in text


def test_auto_prints_the_best_plan_to_paste_and_the_runners_up(tmp_path: Path) -> None:
    script = tmp_path / "llama8b.py"
    script.write_text(SCRIPT)
    result = run(*OPTIONS, "--auto", str(script))
    assert result.exit_code == 0, result.output
    assert "Best:" in result.output and "epl.Config(" in result.output and "Runners-up" in result.output
    found = json.loads(run(*OPTIONS, "--auto", "--json", str(script)).output)
    assert found["searched"] == len(found["plans"]) > 10 and found["search_seconds"] < 5
    assert found["plans"][0]["fits"]


def test_estimates_need_the_device_the_batch_and_the_sequence(tmp_path: Path) -> None:
    script = tmp_path / "llama8b.py"
    script.write_text(SCRIPT)
    result = run("plan", "-n", "8", "--device", "h100-sxm", str(script))
    assert result.exit_code == 2 and "--global-batch-size and --sequence-length" in result.output


def test_a_script_under_amp_is_planned_as_autocast_unless_dtype_is_given(tmp_path: Path) -> None:
    """``amp.level`` runs autocast over float32 weights: more memory than bf16 weights with float32 masters."""
    script = tmp_path / "llama8b_amp.py"
    script.write_text(SCRIPT.replace('"zero.level": "v1"', '"zero.level": "v1", "amp.level": "O1"'))
    autocast = run(*OPTIONS, str(script))
    assert autocast.exit_code == 0, autocast.output
    assert "bf16 autocast over float32 weights" in autocast.output
    given = run(*OPTIONS, "--dtype", "bf16", str(script))
    assert "autocast" not in given.output
    peaks = [json.loads(run(*OPTIONS, *extra, "--json", str(script)).output)["memory_per_device"]["peak"]
             for extra in ((), ("--dtype", "bf16"))]  # fmt: skip
    assert peaks[0] > peaks[1], peaks
