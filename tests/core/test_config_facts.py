"""Typed configuration: each package reads its own keys through its frozen, typed view (a ``settings.py`` module),
no package reads another's keys (they read the owner's typed facts, ``epl.interfaces.facts``), and reading a key
nobody declares is an error."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest

import epl
from epl.config.catalogue import owner_of
from epl.interfaces.facts import OWNERS, Communication, MemoryTechniques, PipelineChoices
from epl.plugins.facts import config_facts

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {
    "epl-core": ROOT / "packages" / "epl-core" / "src",
    "epl-comm": ROOT / "packages" / "epl-comm" / "src",
    "epl-memory": ROOT / "packages" / "epl-memory" / "src",
    "epl-pipeline": ROOT / "packages" / "epl-pipeline" / "src",
    "epl-launch": ROOT / "packages" / "epl-launch" / "src",
}
#: A read of a config key by name: ``config["a.b"]`` or ``config.get("a.b"`` (not an assignment: the planner writes
#: the config that realises a layout, keys of every package included).
READ = re.compile(r'config(?:\.get\(|\[)\s*"([a-z_0-9]+\.[a-z_0-9]+)"(?!\]\s*=[^=])')


def reads_of_other_packages() -> list[str]:
    found = []
    for package, root in SOURCES.items():
        for path in sorted(root.rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                for match in READ.finditer(line):
                    owner = owner_of(match.group(1)) or "epl-core"
                    if owner not in (package, "epl-core"):
                        found.append(f"{path.relative_to(ROOT)}:{number} reads {owner}'s {match.group(1)}")
    return found


def test_no_package_reads_another_packages_keys() -> None:
    """Each package reads its own keys and the core's; a fact it needs of another package's keys comes as that
    package's typed record (``context.facts(Communication)``)."""
    assert reads_of_other_packages() == []


#: The one module of each package that reads its keys by name: the package's typed view of them.
VIEWS = {
    "epl-core": "epl/config/settings.py",
    "epl-comm": "epl_comm/settings.py",
    "epl-memory": "epl_memory/settings.py",
    "epl-pipeline": "epl_pipeline/settings.py",
}

#: The Config class, whose docs show a read by name.
CONFIG_ITSELF = "epl/config/config.py"


def reads_outside_the_views() -> list[str]:
    found = []
    for package, root in SOURCES.items():
        for path in sorted(root.rglob("*.py")):
            if str(path.relative_to(root)) in (VIEWS.get(package), CONFIG_ITSELF):
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                found += [f"{path.relative_to(ROOT)}:{number} reads {m.group(1)}" for m in READ.finditer(line)]
    return found


def test_each_package_reads_its_keys_through_its_typed_view() -> None:
    """A key is read by name in one place, its package's view; the rest of the package reads typed fields. (The
    checks that name a key in their error loop over key names, which this scan, of literal names, leaves alone.)"""
    assert reads_outside_the_views() == []


def _views() -> list[type]:
    from epl.config.settings import CoreSettings
    from epl_comm.settings import CommSettings
    from epl_memory.settings import MemorySettings
    from epl_pipeline.settings import PipelineSettings

    return [CoreSettings, CommSettings, MemorySettings, PipelineSettings]


def _fields(view: object, prefix: str = "") -> dict[str, object]:
    """Each leaf field of a view by its dotted path (``optimizer.max_grad_norm``)."""
    leaves: dict[str, object] = {}
    for field in dataclasses.fields(view):  # type: ignore[arg-type]
        value = getattr(view, field.name)
        if dataclasses.is_dataclass(value):
            leaves.update(_fields(value, f"{prefix}{field.name}."))
        else:
            leaves[prefix + field.name] = value
    return leaves


@pytest.mark.parametrize("view", _views(), ids=lambda view: view.__name__)
def test_a_view_is_frozen_typed_built_once_and_defaults_as_its_keys(view: type) -> None:
    config = epl.Config({})
    built = view.from_config(config)  # type: ignore[attr-defined]
    assert built is view.from_config(config)  # type: ignore[attr-defined]
    assert built is not view.read(config)  # type: ignore[attr-defined]  # read builds anew; from_config keeps one
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(built, dataclasses.fields(built)[0].name, None)
    for name, hint in typing.get_type_hints(view).items():
        assert hint is not typing.Any, (view.__name__, name)
    # every field is a declared key, with the key's default (a field named for its key, or its section's last part)
    assert built == view(), f"{view.__name__}'s defaults differ from its keys' defaults"
    for path, value in _fields(built).items():
        key = path if path.count(".") == 1 else None
        if key is not None and key in config.keys():
            default = config[key]
            assert value == (tuple(default) if isinstance(default, list) else default), (view.__name__, key)


def test_the_scan_sees_a_read_and_ignores_a_write() -> None:
    assert READ.search('if context.config["zero.level"]:')
    assert READ.search('x = config.get("communication.fp16", False)')
    assert not READ.search('config["zero.level"] = self.zero')


def test_the_owners_build_their_facts_from_their_keys() -> None:
    config = epl.Config({"communication.gradients_reduce_method": "sum", "communication.timeout": 30,
                         "zero.level": "v2", "amp.level": "O1", "pipeline.strategy": "ZeroBubble",
                         "auto.auto_parallel": "plan"})  # fmt: skip
    assert config_facts(config, Communication) == Communication(mean=False, timeout_s=30.0)
    assert config_facts(config, MemoryTechniques) == MemoryTechniques(zero="v2", mixed_precision=True)
    assert config_facts(config, PipelineChoices) == PipelineChoices(schedule="ZeroBubble", planned=True)
    assert config_facts(config, Communication) is config_facts(config, Communication)  # built once


def test_without_the_owner_a_record_holds_its_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    from epl.plugins import reset_plugin_manager

    monkeypatch.setenv("EPL_DISABLE_EXTERNAL_PLUGINS", ",".join(OWNERS.values()))
    reset_plugin_manager()
    try:
        config = epl.Config({})
        for kind in OWNERS:
            assert config_facts(config, kind) == kind()
    finally:
        monkeypatch.delenv("EPL_DISABLE_EXTERNAL_PLUGINS")
        reset_plugin_manager()


def test_reading_a_key_nobody_declares_is_an_error() -> None:
    config = epl.Config({})
    with pytest.raises(epl.ConfigError, match="Unknown config key 'zero.levle'"):
        config.get("zero.levle")
    with pytest.raises(epl.ConfigError, match="Unknown config key 'pipline.num_micro_batch'"):
        config.get("pipline.num_micro_batch", 1)
    assert config.get("pipeline.num_micro_batch") == 1
