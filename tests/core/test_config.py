"""epl.Config: every manual key with its default, validation errors, sources and precedence."""

from __future__ import annotations

import json
import pickle

import pytest

import epl
import epl.plugins
from epl.plugins import EplPluginManager

#: Every declared key: the core's and those of the installed plugins (each declares its own).
MANUAL_KEYS = tuple(EplPluginManager().config_schema().values())

# The manual's configuration chapter (6.1 - 6.10): key -> default.
MANUAL_DEFAULTS = {
    "pipeline.num_micro_batch": 1,
    "pipeline.num_stages": None,
    "pipeline.strategy": "PreferBackward",
    "gradient_checkpoint.type": "",
    "gradient_checkpoint.end_taskgraph": -1,
    "gradient_checkpoint.check_gradients": False,
    "zero.level": "",
    "offload.level": "",
    "amp.level": "",
    "amp.debug_log": False,
    "amp.loss_scale": "dynamic",
    "optimizer.num_apply_group": 1,
    "cluster.device_place_prefer_intra_node": True,
    "cluster.run_visible_devices": "",
    "cluster.colocate_split_and_replicate": False,
    "communication.num_communicators": 2,
    "communication.sparse_as_dense": False,
    "communication.max_splits": 5,
    "communication.fp16": False,
    "communication.fp16_scale": 128,
    "communication.clip_after_allreduce": False,
    "communication.gradients_reduce_method": "mean",
    "io.slicing": False,
    "io.unbalanced_io_slicing": False,
    "io.drop_last_files": False,
    "auto.auto_parallel": False,
}


def test_every_manual_key_exists_with_its_default() -> None:
    config = epl.Config()
    assert {k: config[k] for k in MANUAL_DEFAULTS} == MANUAL_DEFAULTS
    assert set(MANUAL_DEFAULTS) <= set(config.keys())


@pytest.mark.parametrize("key", MANUAL_KEYS, ids=lambda k: k.name)
def test_every_key_has_doc_and_default_that_validates(key: epl.ConfigKey) -> None:
    assert key.doc.strip()
    assert key.problem_with(key.default) is None
    assert epl.Config()[key.name] == key.default


def test_attribute_access_reads_sections() -> None:
    config = epl.Config({"pipeline.num_micro_batch": 4})
    assert config.pipeline.num_micro_batch == 4
    assert config.cluster.colocate_split_and_replicate is False


def test_unknown_key_names_the_closest_key() -> None:
    with pytest.raises(
        epl.ConfigError,
        match=r"Unknown config key 'pipeline.num_micro_batches'.*Did you mean 'pipeline.num_micro_batch'",
    ):
        epl.Config({"pipeline.num_micro_batches": 4})


def test_unknown_section_attribute_suggests() -> None:
    with pytest.raises(AttributeError, match="Did you mean 'pipeline'"):
        _ = epl.Config().pipline


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("pipeline.num_micro_batch", "four", r"expected int, got 'four' \(str\)"),
        ("pipeline.num_micro_batch", 0, r"expected a number >= 1, got 0"),
        ("pipeline.num_micro_batch", True, r"expected int, got True \(bool\)"),
        ("pipeline.strategy", 1, r"expected str, got 1"),
        ("cluster.colocate_split_and_replicate", "yes", r"expected bool, got 'yes'"),
        ("communication.gradients_reduce_method", "avg", r"expected one of 'mean', 'sum', got 'avg'"),
        ("amp.loss_scale", "static", r"expected one of 'dynamic' or a number >= 1, got 'static'"),
        ("amp.loss_scale", 0, r"expected .*, got 0"),
        ("zero.level", "v9", r"expected one of .*, got 'v9'"),
    ],
)
def test_wrong_values_name_key_value_and_allowed(key: str, value: object, message: str) -> None:
    with pytest.raises(epl.ConfigError, match=rf"Invalid value for config key '{key}': {message}.*Allowed:"):
        epl.Config({key: value})


def test_valid_values_of_mixed_type_keys() -> None:
    assert epl.Config({"amp.loss_scale": 128})["amp.loss_scale"] == 128
    assert epl.Config({"pipeline.num_stages": 4})["pipeline.num_stages"] == 4


def test_nested_sections_are_accepted() -> None:
    assert epl.Config({"pipeline": {"num_micro_batch": 8}})["pipeline.num_micro_batch"] == 8


def test_environment_variables_set_keys_and_dict_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPL_PIPELINE_NUM_MICRO_BATCH", "4")
    monkeypatch.setenv("EPL_CLUSTER_COLOCATE_SPLIT_AND_REPLICATE", "true")
    monkeypatch.setenv("EPL_PIPELINE_NUM_STAGES", "none")
    config = epl.Config()
    assert config["pipeline.num_micro_batch"] == 4
    assert config.source("pipeline.num_micro_batch") == "env"
    assert config["cluster.colocate_split_and_replicate"] is True
    assert config["pipeline.num_stages"] is None
    assert epl.Config({"pipeline.num_micro_batch": 2})["pipeline.num_micro_batch"] == 2


def test_bad_environment_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPL_PIPELINE_NUM_MICRO_BATCH", "many")
    with pytest.raises(epl.ConfigError, match=r"'pipeline.num_micro_batch' from EPL_PIPELINE_NUM_MICRO_BATCH='many'"):
        epl.Config()


def test_unknown_environment_variable_is_an_error_with_suggestion(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPL_PIPELINE_NUM_MICRO_BATCHES", "4")
    with pytest.raises(
        epl.ConfigError,
        match="EPL_PIPELINE_NUM_MICRO_BATCHES names no EPL config key.*Did you mean 'EPL_PIPELINE_NUM_MICRO_BATCH'",
    ):
        epl.Config()


def test_invalid_values_from_environment_and_file_name_their_origin(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = tmp_path / "epl.toml"
    file.write_text("[amp]\nloss_scale = 0.5\n")
    with pytest.raises(epl.ConfigError, match=r"'amp.loss_scale' \(from config file .*epl.toml\): expected str/int"):
        epl.Config(file=file)
    monkeypatch.setenv("EPL_PIPELINE_NUM_MICRO_BATCH", "0")
    with pytest.raises(epl.ConfigError, match=r"'pipeline.num_micro_batch' \(from EPL_PIPELINE_NUM_MICRO_BATCH\)"):
        epl.Config()


def test_blocked_plugin_is_named_as_blocked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPL_DISABLE_EXTERNAL_PLUGINS", "epl-comm")
    epl.plugins.reset_plugin_manager()
    manager = epl.plugins.get_plugin_manager()
    if "epl-comm" not in manager.blocked:
        pytest.skip("epl-comm is not installed")
    with pytest.raises(epl.MissingPluginError, match="installed but blocked by EPL_DISABLE_EXTERNAL_PLUGINS"):
        epl.init(epl.Config({"communication.fp16": True}))


def test_file_toml_and_json_with_precedence(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    toml = tmp_path / "epl.toml"
    toml.write_text(
        '[pipeline]\nnum_micro_batch = 8\nstrategy = "PreferForward"\n[cluster]\ncolocate_split_and_replicate = true\n'
    )
    config = epl.Config(file=toml)
    assert config["pipeline.num_micro_batch"] == 8
    assert config.source("pipeline.strategy") == "file"
    monkeypatch.setenv("EPL_PIPELINE_NUM_MICRO_BATCH", "2")
    assert epl.Config(file=toml)["pipeline.num_micro_batch"] == 2
    assert epl.Config({"pipeline.num_micro_batch": 3}, file=toml)["pipeline.num_micro_batch"] == 3
    js = tmp_path / "epl.json"
    js.write_text(json.dumps({"communication.max_splits": 7}))
    monkeypatch.setenv("EPL_CONFIG_FILE", str(js))
    assert epl.Config()["communication.max_splits"] == 7


def test_file_errors(tmp_path) -> None:
    with pytest.raises(epl.ConfigError, match="does not exist"):
        epl.Config(file=tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[pipeline\n")
    with pytest.raises(epl.ConfigError, match="is not valid TOML"):
        epl.Config(file=bad)
    typo = tmp_path / "typo.json"
    typo.write_text('{"zero.levle": "v1"}')
    with pytest.raises(
        epl.ConfigError, match=r"Unknown config key 'zero.levle' \(in config file .*typo.json\).*'zero.level'"
    ):
        epl.Config(file=typo)


def test_config_is_read_only_and_with_overrides_validates() -> None:
    config = epl.Config()
    with pytest.raises(AttributeError, match="read-only"):
        config.pipeline.num_micro_batch = 4
    updated = config.with_overrides({"pipeline.num_micro_batch": 4})
    assert updated["pipeline.num_micro_batch"] == 4 and config["pipeline.num_micro_batch"] == 1
    with pytest.raises(epl.ConfigError):
        config.with_overrides({"pipeline.num_micro_batch": -1})


def test_config_pickles_and_compares() -> None:
    config = epl.Config({"pipeline.num_micro_batch": 4})
    assert pickle.loads(pickle.dumps(config)) == config
    assert config != epl.Config()
    assert "pipeline.num_micro_batch" in repr(config)


@pytest.mark.parametrize(
    ("key", "value", "package"),
    [
        ("zero.level", "v1", "epl-memory"),
        ("gradient_checkpoint.type", "auto", "epl-memory"),
        ("amp.level", "O1", "epl-memory"),
        ("offload.level", "v0", "epl-memory"),
        ("optimizer.num_apply_group", 4, "epl-memory"),
        ("communication.fp16", True, "epl-comm"),
        ("communication.gradients_reduce_method", "sum", "epl-comm"),
        ("pipeline.strategy", "PreferForward", "epl-pipeline"),
        ("auto.auto_parallel", True, "epl-pipeline"),
    ],
)
def test_key_of_missing_plugin_fails_naming_the_package(key: str, value: object, package: str) -> None:
    core_alone = EplPluginManager(load_entry_points=False)
    config = epl.Config({key: value}, plugin_manager=core_alone)  # building it is fine: the key exists
    with pytest.raises(
        epl.MissingPluginError, match=rf"'{key}' = .* needs the package {package}.*pip install {package}"
    ):
        config.check_plugins(core_alone)


def test_epl_init_checks_the_plugins_of_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPL_DISABLE_EXTERNAL_PLUGINS", "epl-memory")
    with pytest.raises(epl.MissingPluginError, match="'zero.level' = 'v1' needs the plugin epl-memory.*blocked"):
        epl.init(epl.Config({"zero.level": "v1"}))


def test_default_values_of_plugin_keys_need_no_plugin() -> None:
    env = epl.init(epl.Config({"pipeline.num_micro_batch": 4, "cluster.colocate_split_and_replicate": True}))
    assert env.config["pipeline.num_micro_batch"] == 4


def test_init_accepts_a_dict_and_rejects_other_types() -> None:
    assert epl.init({"pipeline.num_micro_batch": 2}).config["pipeline.num_micro_batch"] == 2
    with pytest.raises(epl.ConfigError, match="takes an epl.Config"):
        epl.init(42)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_numbers_must_be_finite(value: float) -> None:
    with pytest.raises(epl.ConfigError, match=r"'communication.timeout': expected a finite number"):
        epl.Config({"communication.timeout": value})


def test_max_grad_norm_takes_inf_to_measure_the_norm_without_clipping(monkeypatch: pytest.MonkeyPatch) -> None:
    assert epl.Config({"optimizer.max_grad_norm": float("inf")})["optimizer.max_grad_norm"] == float("inf")
    monkeypatch.setenv("EPL_OPTIMIZER_MAX_GRAD_NORM", "inf")
    assert epl.Config()["optimizer.max_grad_norm"] == float("inf")
    for value in (float("nan"), float("-inf")):
        with pytest.raises(epl.ConfigError, match="'optimizer.max_grad_norm'"):
            epl.Config({"optimizer.max_grad_norm": value})
