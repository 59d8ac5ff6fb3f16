"""examples/plugin, the example plugin package docs/plugins.md walks through, installed as a real distribution.

Its entry point is discovered, its config key is declared with the plugin as ``provided_by``, its
``epl`` subcommand runs, its schedule is valid and trains a real two-stage pipeline to the one-process
result, its model transform is a no-op unless its key is set, and it imports nothing of epl-core but
``epl.plugin_api``. The package must be installed (``pip install -e examples/plugin``; nox does it).
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result
from torch import nn

from epl.cli import make_cli
from tests.helpers.distributed import run_ranks
from tests.helpers.imports import imports_of, modules_of, outside_api, private_names
from tests.helpers.reference import train_locally

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "examples" / "plugin"
DISTRIBUTION = "epl-example-plugin"
KEY = "example.check_finite"
SCHEDULE = "InOrderBackward"

MICRO, BATCH, STEPS = 4, 8, 3


def run(*args: str) -> Result:
    return CliRunner().invoke(make_cli(), list(args))


# -- (a) the entry point --------------------------------------------------------------------------------


def test_the_entry_point_is_the_distribution_and_names_the_hooks_module() -> None:
    (entry_point,) = importlib.metadata.entry_points(group="epl", name=DISTRIBUTION)
    assert entry_point.value == "epl_example_plugin.plugin"
    assert entry_point.dist is not None and entry_point.dist.metadata["Name"] == DISTRIBUTION
    project = tomllib.loads((PACKAGE / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["epl"] == {DISTRIBUTION: "epl_example_plugin.plugin"}
    # epl-core is its only EPL dependency: the schedule runs under epl-pipeline, which it does not import
    assert [d for d in project["dependencies"] if d.startswith("epl")] == ["epl-core>=0.1.0"]


def test_epl_plugins_lists_it_with_its_hooks() -> None:
    result = run("plugins")
    assert result.exit_code == 0, result.output
    version = importlib.metadata.version(DISTRIBUTION)
    listing = re.search(
        rf"^{DISTRIBUTION}  \({DISTRIBUTION} {re.escape(version)}\)\n    hooks: (.*)$", result.output, re.M
    )
    assert listing is not None, result.output
    assert listing.group(1).split(", ") == [
        "epl_cli_commands",
        "epl_config_keys",
        "epl_model_transforms",
        "epl_pipeline_schedules",
    ]


def test_blocking_it_removes_its_key_and_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    import epl
    from epl.plugins import get_plugin_manager, reset_plugin_manager

    monkeypatch.setenv("EPL_DISABLE_EXTERNAL_PLUGINS", DISTRIBUTION)
    reset_plugin_manager()
    manager = get_plugin_manager()
    assert not manager.has_plugin(DISTRIBUTION) and DISTRIBUTION in manager.blocked
    assert SCHEDULE not in manager.pipeline_schedules()
    with pytest.raises(epl.ConfigError, match=f"Unknown config key '{KEY}'"):
        epl.Config({KEY: True})


# -- (b) the config key ---------------------------------------------------------------------------------


def test_its_key_is_declared_by_it() -> None:
    import epl

    key = epl.Config().keys()[KEY]
    assert key.provided_by == DISTRIBUTION
    assert (key.types, key.default) == ((bool,), False)
    assert epl.Config()[KEY] is False
    assert epl.Config({"example": {"check_finite": True}})[KEY] is True


def test_its_hooks_read_the_key_through_its_view() -> None:
    import epl
    from epl.plugin_api import ConfigView
    from epl_example_plugin.settings import ExamplePluginSettings

    config = epl.Config({KEY: True}, environ={})
    view = ExamplePluginSettings.from_config(config)
    assert issubclass(ExamplePluginSettings, ConfigView) and view.example.check_finite is True
    assert view is ExamplePluginSettings.from_config(config)  # built once per Config
    assert ExamplePluginSettings.from_config(epl.Config({}, environ={})) == ExamplePluginSettings()


@pytest.mark.parametrize("value", [1, "yes", None])
def test_its_key_rejects_a_wrong_type(value: object) -> None:
    import epl

    with pytest.raises(epl.ConfigError, match=rf"Invalid value for config key '{KEY}'.*expected bool"):
        epl.Config({KEY: value})


def test_its_key_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import epl

    monkeypatch.setenv("EPL_EXAMPLE_CHECK_FINITE", "yes")
    config = epl.Config()
    assert (config[KEY], config.source(KEY)) == (True, "env")


# -- (c) the CLI command --------------------------------------------------------------------------------


def test_example_info_shows_the_key_and_draws_the_schedule() -> None:
    result = run("example-info", "--stages", "3", "--micro-batches", "2")
    assert result.exit_code == 0, result.output
    assert f"  {KEY} = False (default; env EPL_EXAMPLE_CHECK_FINITE)" in result.output
    assert f"  {SCHEDULE} (registered), 3 stages x 2 micro-batches:" in result.output
    assert "    stage 0: 0F0 0F1 0B0 0B1\n" in result.output
    assert "    stage 2: 2F0 2F1 2B0 2B1\n" in result.output
    assert "runs with epl-pipeline" in result.output


def test_example_info_shows_a_value_from_the_environment_and_reports_a_bad_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("EPL_EXAMPLE_CHECK_FINITE", "on")
    result = run("example-info")
    assert result.exit_code == 0, result.output
    assert f"  {KEY} = True (env; env EPL_EXAMPLE_CHECK_FINITE)" in result.output
    monkeypatch.setenv("EPL_EXAMPLE_CHECK_FINITE", "perhaps")
    result = run("example-info")
    assert result.exit_code == 1 and "EPL_EXAMPLE_CHECK_FINITE" in result.output, result.output


def test_epl_schedule_of_epl_pipeline_draws_it() -> None:
    result = run("schedule", "--stages", "2", "--micro-batches", "3", "--strategy", SCHEDULE)
    assert result.exit_code == 0, result.output
    assert "stage 0: F0 F1 F2" in result.output and f"{SCHEDULE}: 2 stages x 3 micro-batches" in result.output


# -- (d) the schedule -----------------------------------------------------------------------------------


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("micro", [1, 2, 5, 8])
def test_the_schedule_is_valid_and_is_not_gpipe_or_1f1b(stages: int, micro: int) -> None:
    from epl.plugins import get_plugin_manager
    from epl_pipeline.schedules import build, check, gpipe, one_f_one_b, peak_in_flight, simulate

    schedule = build(SCHEDULE, get_plugin_manager().pipeline_schedules(), stages, micro)
    check(schedule, stages, micro)  # also: neighbouring stages exchange micro-batches in the same order
    for s, actions in enumerate(schedule):
        assert [str(a) for a in actions] == [f"{s}F{m}" for m in range(micro)] + [f"{s}B{m}" for m in range(micro)]
        assert peak_in_flight(list(actions)) == micro
    assert simulate(schedule) == simulate(gpipe(stages, micro))  # GPipe's shape: same makespan and bubble
    if micro > 1:
        assert schedule != gpipe(stages, micro)
    if micro > 1 and stages > 1:
        assert schedule != one_f_one_b(stages, micro)


def test_the_order_check_catches_stages_that_disagree() -> None:
    from epl_example_plugin.schedules import in_order_backward
    from epl_pipeline.schedules import check, gpipe

    mixed = [in_order_backward(2, 3)[0], gpipe(2, 3)[1]]
    # stage 1 sends micro-batch 2's input gradient first, where stage 0 waits for micro-batch 0's
    with pytest.raises(ValueError, match="stage 1 sends its input gradients"):
        check(mixed, 2, 3)


def build_model() -> nn.Module:
    import epl

    torch.manual_seed(0)
    with epl.replicate(device_count=1, name="stage_0"):
        stage0 = nn.Sequential(nn.Linear(6, 16), nn.Tanh())
    with epl.replicate(device_count=1, name="stage_1"):
        stage1 = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 6))
    return nn.Sequential(stage0, stage1).double()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(BATCH, 6, generator=generator, dtype=torch.float64),
            torch.randn(BATCH, 6, generator=generator, dtype=torch.float64),
        )
        for _ in range(STEPS)
    ]


def train_pipelined() -> dict[str, Any]:
    """One rank of the two-stage pipeline under the plugin's schedule, found through its entry point."""
    import epl

    epl.init(epl.Config({"pipeline.num_micro_batch": MICRO, "pipeline.strategy": SCHEDULE, KEY: True}))
    engine = epl.parallelize(build_model(), optimizer=lambda p: torch.optim.Adam(p, lr=1e-2), loss_fn=nn.MSELoss())
    losses = [float(engine.step(x, y)) for x, y in batches()]
    runner = engine.context.step_runner
    from epl_example_plugin.transforms import ExampleState

    return {
        "losses": losses,
        "stage": runner.stage,
        "actions": [str(a) for a in runner.actions],
        "checked": engine.context.state(ExampleState).checked,
        "state": {k: v.clone() for k, v in engine.model.state_dict().items()},
    }


@pytest.mark.multiprocess
def test_the_schedule_trains_a_two_stage_pipeline_to_the_one_process_result() -> None:
    import epl

    ranks = run_ranks(train_pipelined, 2, timeout=120)
    epl.init()
    model = build_model()
    expected_losses, expected_state = train_locally(
        model, torch.optim.Adam(model.parameters(), lr=1e-2), batches(), MICRO
    )
    assert sorted(r["stage"] for r in ranks) == [0, 1]
    for result in ranks:
        s = result["stage"]
        assert result["actions"] == [f"{s}F{m}" for m in range(MICRO)] + [f"{s}B{m}" for m in range(MICRO)]
        assert result["checked"] == list(result["state"])  # the transform ran on this stage's parameters only
        # backwards in micro-batch order sum each gradient in the local loop's order: equal to the bit
        torch.testing.assert_close(result["losses"], expected_losses, rtol=0, atol=0)
        assert len(result["state"]) == (2 if s == 0 else 4)
        for name, value in result["state"].items():
            torch.testing.assert_close(value, expected_state[name], rtol=0, atol=0, msg=f"stage {s} {name}")


# -- the model transform --------------------------------------------------------------------------------


def parallelize_one_process(check_finite: bool, poison: bool) -> Any:
    import epl

    epl.init(epl.Config({KEY: check_finite}))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    if poison:
        with torch.no_grad():
            model[2].bias[0] = float("nan")
    return epl.parallelize(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.MSELoss())


def test_the_transform_stops_a_model_with_a_nan_when_its_key_is_set() -> None:
    import epl

    with pytest.raises(epl.EplError, match=rf"Parameter '2\.bias' of rank 0 holds NaN or inf .*\({KEY} is set\)"):
        parallelize_one_process(check_finite=True, poison=True)


def test_the_transform_is_a_no_op_unless_its_key_is_set() -> None:
    from epl_example_plugin.transforms import ExampleState

    engine = parallelize_one_process(check_finite=False, poison=True)  # nothing checks: it trains (to NaN)
    assert engine.context.state(ExampleState).checked == []
    engine = parallelize_one_process(check_finite=True, poison=False)
    assert engine.context.state(ExampleState).checked == ["0.weight", "0.bias", "2.weight", "2.bias"]
    loss = engine.step(torch.ones(4, 3), torch.zeros(4, 1))
    assert torch.isfinite(loss)


def test_the_transform_has_a_phase_and_a_name() -> None:
    from epl.plugin_api import TransformPhase
    from epl_example_plugin.transforms import CheckFinite

    assert CheckFinite.phase is TransformPhase.CHECKPOINT
    assert TransformPhase.SYNC_WEIGHTS < CheckFinite.phase < TransformPhase.OFFLOAD
    assert TransformPhase.PARTITION_PARAMETERS < TransformPhase.MATERIALIZE  # ZeRO chunks before values are given
    assert CheckFinite.name == "example_check_finite"


# -- (e) it imports only the plugin API -----------------------------------------------------------------


def test_it_imports_nothing_of_epl_but_the_plugin_api() -> None:
    import epl.plugin_api

    modules = modules_of([PACKAGE / "src"])
    assert {"epl_example_plugin", "epl_example_plugin.plugin", "epl_example_plugin.schedules"} <= set(modules)
    imports = imports_of(modules)
    imported = {item.imported for item in imports}
    assert "epl.plugin_api" in imported  # the check below sees the package's imports
    assert outside_api(imports, "epl_example_plugin", "epl", "epl.plugin_api") == []
    assert private_names(modules, "epl_example_plugin", "epl") == []
    others = sorted(
        i.where() for i in imports if i.imported.split(".")[0] in {"epl_pipeline", "epl_comm", "epl_memory"}
    )
    assert others == [], "the example depends on epl-core only"
    names = set()
    for file in modules.values():
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "epl.plugin_api":
                names.update(alias.name for alias in node.names)
    assert names and names <= set(epl.plugin_api.__all__)
