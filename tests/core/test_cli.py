"""The ``epl`` command: config, plan and plugins."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from epl.cli import make_cli
from epl.cli.config_command import render_markdown
from epl.config import Config

REPO = Path(__file__).resolve().parents[2]


def run(*args: str) -> Result:
    return CliRunner().invoke(make_cli(), list(args))


def test_config_table_lists_every_key_with_default_and_package() -> None:
    result = run("config")
    assert result.exit_code == 0, result.output
    for name, key in Config().keys().items():
        assert f"{name} = {key.default!r}" in result.output
    assert "[pipeline]" in result.output and "package epl-memory" in result.output
    assert "env EPL_PIPELINE_NUM_MICRO_BATCH" in result.output


def test_config_shows_sources_of_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = tmp_path / "epl.toml"
    file.write_text("[communication]\nmax_splits = 3\n")
    monkeypatch.setenv("EPL_CLUSTER_COLOCATE_SPLIT_AND_REPLICATE", "1")
    result = run("config", "--config-file", str(file), "--set", "pipeline.num_micro_batch=4", "--format", "json")
    rows = {row["key"]: row for row in json.loads(result.output)}
    assert (rows["pipeline.num_micro_batch"]["value"], rows["pipeline.num_micro_batch"]["source"]) == (4, "dict")
    assert (rows["communication.max_splits"]["value"], rows["communication.max_splits"]["source"]) == (3, "file")
    assert rows["cluster.colocate_split_and_replicate"]["source"] == "env"


def test_config_errors_are_one_clear_line() -> None:
    result = run("config", "--set", "pipeline.num_micro_batchs=4")
    assert result.exit_code == 1
    assert "Unknown config key 'pipeline.num_micro_batchs'" in result.output
    assert "Did you mean 'pipeline.num_micro_batch'?" in result.output
    result = run("config", "--set", "pipeline.num_micro_batch=four")
    assert result.exit_code == 1 and "cannot read 'four' as int" in result.output


def test_docs_config_page_is_generated_from_the_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    from epl.plugins import reset_plugin_manager

    monkeypatch.setenv("EPL_DISABLE_EXTERNAL_PLUGINS", "epl-example-plugin")  # the docs list EPL's own packages
    reset_plugin_manager()
    page = (REPO / "docs" / "config.md").read_text()
    assert render_markdown(Config()) in page, "docs/config.md is stale: run `epl config --format markdown`"


@pytest.mark.parametrize(
    ("world", "expected"), [(8, "4 replicas x 2 devices per replica"), (1024, "512 replicas x 2 devices")]
)
def test_plan_of_a_manual_example(world: int, expected: str) -> None:
    result = run("plan", "--world-size", str(world), "--example", "pipeline")
    assert result.exit_code == 0, result.output
    assert expected in result.output and "stage_0" in result.output


def test_plan_of_a_script_with_its_arguments(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import sys, torch, epl\n"
        "from torch import nn\n"
        "stages = int(sys.argv[sys.argv.index('--stages') + 1])\n"
        "epl.init(epl.Config({'pipeline.num_micro_batch': 4}))\n"
        "parts = []\n"
        "for s in range(stages):\n"
        "    with epl.replicate(1, name=f's{s}'):\n"
        "        parts.append(nn.Linear(4, 4))\n"
        "engine = epl.parallelize(nn.Sequential(*parts), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))\n"
        "raise SystemExit('training must not start in a plan-only run')\n"
    )
    result = run("plan", "-n", "8", "--gpu-per-worker", "4", "--json", str(script), "--stages", "4")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert (plan["num_replicas"], plan["devices_per_replica"], plan["gpu_per_worker"]) == (2, 4, 4)
    assert [tg["name"] for tg in plan["taskgraphs"]] == ["s0", "s1", "s2", "s3"]


def test_plan_applies_overrides_and_total_gpu_num_is_the_planned_world() -> None:
    result = run("plan", "-n", "16", "--gpu-per-worker", "8", "--example", "moe")
    assert result.exit_code == 0, result.output
    assert "split(16)" in result.output and "replicate(16)" in result.output
    result = run("plan", "-n", "4", "--example", "pipeline", "--set", "cluster.device_place_prefer_intra_node=false")
    assert "0, 1" in result.output and "column-major" in result.output


def test_plan_errors(tmp_path: Path) -> None:
    result = run("plan", "-n", "3", "--example", "pipeline")
    assert result.exit_code == 1 and "world size 3 is not a multiple of 2" in result.output
    result = run("plan", "-n", "2")
    assert result.exit_code == 2 and "Give a SCRIPT or --example NAME" in result.output
    idle = tmp_path / "idle.py"
    idle.write_text("import epl\nepl.init()\n")
    result = run("plan", "-n", "2", str(idle))
    assert result.exit_code == 1 and "finished without calling epl.parallelize()" in result.output


def test_plugins_lists_the_core() -> None:
    result = run("plugins")
    assert result.exit_code == 0 and "epl-core  (built in)" in result.output
    assert "epl_make_step_runner" in result.output


def test_console_script_entry_point() -> None:
    from importlib.metadata import entry_points

    (script,) = [ep for ep in entry_points(group="console_scripts") if ep.name == "epl"]
    assert script.value == "epl.cli:main"


def test_plan_of_a_script_that_prints_and_imports_its_neighbours(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "mymodel.py").write_text("from torch import nn\ndef build():\n    return nn.Linear(2, 2)\n")
    (tmp_path / "train.py").write_text(
        "import epl\nfrom mymodel import build\nprint('starting')\nepl.init()\nepl.parallelize(build())\n"
    )
    monkeypatch.chdir("/")
    result = CliRunner().invoke(make_cli(), ["plan", "-n", "2", "--json", str(tmp_path / "train.py")])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["num_replicas"] == 2
    assert "starting" in result.stderr


def test_example_names_match_the_examples() -> None:
    from epl import examples
    from epl.examples.manual import EXAMPLES

    assert examples.names() == sorted(EXAMPLES)


@pytest.mark.parametrize("world", [1, 2])
def test_plan_of_a_script_that_cannot_be_split_exits_non_zero(tmp_path: Path, world: int) -> None:
    """The real run would fail (a module no split rule covers), in one process too: ``epl plan`` says so, exits 1."""
    script = tmp_path / "train.py"
    script.write_text(
        "import torch, epl\n"
        "from torch import nn\n"
        "class Mixer(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.mixing = nn.Parameter(torch.eye(4))\n"
        "    def forward(self, x):\n"
        "        return x @ self.mixing\n"
        "epl.init()\n"
        "with epl.split(2):\n"
        "    model = nn.Sequential(nn.Linear(4, 4), Mixer())\n"
        "epl.parallelize(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))\n"
    )
    result = CliRunner().invoke(make_cli(), ["plan", "-n", str(world), str(script)])
    assert result.exit_code == 1
    assert "holds the module '1'" in result.output and "Mixer" in result.output
    assert "def epl_split_rules" in result.output and "Traceback" not in result.output


def split_script(tmp_path: Path, model: str, *, device_count: int = 2, after: str = "") -> Path:
    """A script that builds ``model`` (an expression) under ``epl.split(device_count)``."""
    script = tmp_path / "train.py"
    script.write_text(
        "import torch, epl\n"
        "from torch import nn\n"
        "epl.init()\n"
        f"with epl.split({device_count}, name='tp'):\n"
        f"    model = {model}\n"
        f"{after}"
        "epl.parallelize(model, optimizer=torch.optim.Adam)\n"
    )
    return script


@pytest.mark.parametrize(
    ("model", "device_count", "after", "message"),
    [
        ("epl.nn.Experts(3, 8, 16)", 2, "", "3 experts cannot be shared equally by 2 devices"),
        (
            "nn.Sequential(nn.Linear(8, 2), nn.ReLU(), nn.Linear(2, 8))",
            4,
            "",
            "0: the output features of the linear layer: 2 cannot be shared",
        ),
    ],
)
def test_plan_of_a_script_whose_sizes_do_not_split_exits_non_zero(
    tmp_path: Path, model: str, device_count: int, after: str, message: str
) -> None:
    """What the run would refuse while sharding, ``epl plan`` refuses with the same message, without a traceback."""
    script = split_script(tmp_path, model, device_count=device_count, after=after)
    result = run("plan", "-n", str(device_count), str(script))
    assert result.exit_code == 1, result.output
    assert message in result.output and "Traceback" not in result.output


MLP = """\
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.gate_proj = nn.Linear(16, 64, bias=False)
        self.down_proj = nn.Linear(64, 16, bias=False)
    def forward(self, x):
        return x + self.down_proj(torch.relu(self.gate_proj(self.norm(x))))
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(16, 10)
    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)
"""


def test_plan_of_a_split_script_shows_each_devices_shards(tmp_path: Path) -> None:
    """One line per layer-numbers-as-``*`` pattern and shapes; devices holding alike share a table; JSON too."""
    script = split_script(tmp_path, "Net()")
    script.write_text(script.read_text().replace("epl.init()\n", MLP + "epl.init()\n"))
    result = run("plan", "-n", "4", str(script))
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "shards of tp (split(2)), per device of replica 0; every replica alike:\n  each of devices 0, 1:" in text
    rows = [" ".join(line.split()) for line in text.split("each of devices 0, 1:")[1].split("\n\n")[0].splitlines()]
    assert rows[1:] == [
        "layers.*.norm.weight [16] whole x4",
        "layers.*.norm.bias [16] whole x4",
        "layers.*.gate_proj.weight [32, 16] of [64, 16] x4",
        "layers.*.down_proj.weight [16, 32] of [16, 64] x4",
        "head.weight [5, 16] of [10, 16]",
        "head.bias [5] of [10]",
    ]
    plan = json.loads(run("plan", "-n", "4", "--json", str(script)).stdout)
    (tp,) = plan["taskgraphs"]
    assert len(tp["shards"]) == 2 and tp["shards"][0] == tp["shards"][1]
    assert tp["shards"][0][2] == {
        "name": "layers.*.gate_proj.weight",
        "module": "Linear",
        "shape": [32, 16],
        "whole": [64, 16],
        "sharded": True,
        "tied": [],
        "count": 4,
        "why": "",
    }


def test_plan_shows_uneven_shards_device_by_device(tmp_path: Path) -> None:
    script = split_script(tmp_path, "nn.Sequential(nn.Linear(8, 15), nn.ReLU(), nn.Linear(15, 6), nn.LayerNorm(6))")
    result = run("plan", "-n", "2", str(script))
    assert result.exit_code == 0, result.output
    device_0, device_1 = result.stdout.split("  device 0:\n")[1].split("\n\n")[0].split("  device 1:\n")
    assert "0.weight  [8, 8]  of [15, 8]" in device_0 and "0.weight  [7, 8]  of [15, 8]" in device_1
    assert "2.weight  [6, 7]  of [6, 15]" in device_1
    assert "2.bias    [6]     whole" in device_1 and "3.bias    [6]     whole" in device_1  # not one ``*.bias`` row


LLAMA = (
    "__import__('transformers').LlamaForCausalLM(__import__('transformers').LlamaConfig(vocab_size=64, "
    "hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads={heads}, num_key_value_heads=2, "
    "attn_implementation='sdpa'))"
)


def test_plan_of_a_transformers_llama_shows_megatrons_layout(tmp_path: Path) -> None:
    """The shards the run makes (from the model's computation): q/k/v, gate/up by rows, o and down by columns."""
    result = run("plan", "-n", "2", str(split_script(tmp_path, LLAMA.format(heads=4))))
    assert result.exit_code == 0, result.output
    rows = {" ".join(line.split()) for line in result.stdout.splitlines()}
    for row in [
        "model.layers.*.self_attn.q_proj.weight [16, 32] of [32, 32] x2",
        "model.layers.*.self_attn.k_proj.weight [8, 32] of [16, 32] x2",  # whole key/value heads
        "model.layers.*.self_attn.o_proj.weight [32, 16] of [32, 32] x2",  # row parallel
        "model.layers.*.mlp.down_proj.weight [32, 24] of [32, 48] x2",
        "model.layers.*.input_layernorm.weight [32] whole x2",
        "model.embed_tokens.weight [32, 32] of [64, 32]",
    ]:
        assert row in rows, result.stdout


def test_plan_of_a_transformers_llama_whose_heads_do_not_divide_exits_non_zero(tmp_path: Path) -> None:
    script = split_script(tmp_path, LLAMA.format(heads=6).replace("hidden_size=32", "hidden_size=24"), device_count=4)
    result = run("plan", "-n", "4", str(script))
    assert result.exit_code == 1, result.output
    assert "6 attention heads of 4 features each cannot be shared equally by 4 devices" in result.output


def test_plan_of_split_stages_shows_the_grid_and_each_stages_shards(tmp_path: Path) -> None:
    """Two split(2) stages on 8 devices: tensor parallel inside each stage, 2 stages, 2 replicas."""
    script = split_script(
        tmp_path,
        "nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 8))",
        after="with epl.split(2, name='second'):\n    model = nn.Sequential(model, nn.Linear(8, 4))\n",
    )
    result = run("plan", "-n", "8", str(script))
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "2 replicas x 4 devices per replica, 2 pipeline stages" in text
    assert "0          tp      split(2)" in text and "0, 1, 4, 5" in text and "2, 3, 6, 7" in text
    rows = {" ".join(line.split()) for line in text.splitlines()}
    assert "0.2.weight [8, 8] of [8, 16]" in rows  # the first stage's pair: row parallel
    assert "1.weight [2, 8] of [4, 8]" in rows  # the second stage's lone Linear: column parallel


def test_a_command_of_a_missing_package_names_the_package() -> None:
    from click.testing import CliRunner

    from epl.cli import make_cli
    from epl.plugins import EplPluginManager

    core_only = EplPluginManager(load_entry_points=False)
    result = CliRunner().invoke(make_cli(core_only), ["launch", "train.py"])
    assert result.exit_code == 2
    assert "epl launch is provided by the package epl-launch, which is not installed: pip install epl-launch" in (
        result.output
    )
    result = CliRunner().invoke(make_cli(core_only), ["lanch"])
    assert result.exit_code == 2 and "No such command 'lanch'" in result.output
