"""Typed configuration: each package reads its own keys through its frozen, typed view (a ``settings.py`` module)
that names exactly the keys the package declares, typed as they are; no package reads another's keys (they read the
owner's typed facts, ``epl.interfaces.facts``), and reading a key nobody declares is an error."""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

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
    "epl-example-plugin": ROOT / "examples" / "plugin" / "src",
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
    "epl-example-plugin": "epl_example_plugin/settings.py",
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


def _views() -> dict[str, type]:
    """Each package's view, by the package (epl-launch declares no key, so has none)."""
    from epl.config.settings import CoreSettings
    from epl_comm.settings import CommSettings
    from epl_example_plugin.settings import ExamplePluginSettings
    from epl_memory.settings import MemorySettings
    from epl_pipeline.settings import PipelineSettings

    return {
        "epl-core": CoreSettings,
        "epl-comm": CommSettings,
        "epl-memory": MemorySettings,
        "epl-pipeline": PipelineSettings,
        "epl-example-plugin": ExamplePluginSettings,
    }


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


@pytest.mark.parametrize("view", _views().values(), ids=lambda view: view.__name__)
def test_a_view_is_frozen_typed_built_once_and_defaults_as_its_keys(view: type) -> None:
    config = epl.Config({})
    built = view.from_config(config)  # type: ignore[attr-defined]
    assert built is view.from_config(config)  # type: ignore[attr-defined]
    assert built is not view.read(config)  # type: ignore[attr-defined]  # read builds anew; from_config keeps one
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(built, dataclasses.fields(built)[0].name, None)
    for section in [getattr(built, f.name) for f in dataclasses.fields(built)]:  # its sections are frozen too
        if dataclasses.is_dataclass(section):
            assert section.__dataclass_params__.frozen, section  # type: ignore[attr-defined]
    for name, hint in typing.get_type_hints(view).items():
        assert hint is not typing.Any, (view.__name__, name)
    # every field is a declared key, with the key's default (a field named for its key, or its section's last part)
    assert built == view(), f"{view.__name__}'s defaults differ from its keys' defaults"
    for path, value in _fields(built).items():
        key = path if path.count(".") == 1 else None
        if key is not None and key in config.keys():
            default = config[key]
            assert value == (tuple(default) if isinstance(default, list) else default), (view.__name__, key)


def declared_keys(package: str) -> dict[str, epl.ConfigKey]:
    """The keys ``package`` declares, by name (the core's have no ``provided_by``)."""
    return {
        name: key
        for name, key in epl.Config({}, environ={}).keys().items()
        if (key.provided_by or "epl-core") == package
    }


def view_keys(view: type, declared: dict[str, epl.ConfigKey]) -> dict[str, tuple[str, Any]]:
    """Key name -> (the field's dotted path, its type hint) for each leaf field of ``view``.

    A field of a section (``optimizer.max_grad_norm``) is named after its key; a field at the top is named after its
    key's attribute (``num_apply_group``: ``optimizer.num_apply_group``), which must be one of ``declared``'s.
    """
    found: dict[str, tuple[str, Any]] = {}
    for name, hint in typing.get_type_hints(view).items():
        if dataclasses.is_dataclass(hint):
            for attribute, inner in typing.get_type_hints(hint).items():
                found[f"{name}.{attribute}"] = (f"{name}.{attribute}", inner)
            continue
        matches = [key for key in declared if key.split(".", 1)[1] == name]
        assert len(matches) == 1, f"{view.__name__}.{name} names no one declared key: {matches}"
        found[matches[0]] = (name, hint)
    return found


@pytest.mark.parametrize("package", sorted(_views()))
def test_a_view_names_exactly_its_packages_keys(package: str) -> None:
    declared = declared_keys(package)
    assert declared, f"{package} declares no key (is it installed?)"
    assert sorted(view_keys(_views()[package], declared)) == sorted(declared)


def _members(hint: Any) -> list[Any]:
    """The members of a union (``X | None``), or ``[hint]``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return list(typing.get_args(hint))
    return [hint]


def expected_hint(key: epl.ConfigKey) -> tuple[set[str], set[type]]:
    """The choices and the other types a field of ``key`` has: a ``Literal`` of the choices instead of ``str``,
    ``float`` for an ``int`` or ``float`` key, a ``tuple`` for a ``list`` one."""
    kinds = set(key.types) - ({str} if key.choices else set()) - ({int} if float in key.types else set())
    return set(key.choices or ()), {tuple if kind is list else kind for kind in kinds}


def actual_hint(hint: Any) -> tuple[set[str], set[type]]:
    """The ``Literal`` values of ``hint`` and its other types (``tuple[str, ...]`` is ``tuple``)."""
    choices: set[str] = set()
    kinds: set[type] = set()
    for member in _members(hint):
        assert member is not Any, hint
        if typing.get_origin(member) is Literal:
            choices.update(typing.get_args(member))
        else:
            kinds.add(typing.get_origin(member) or member)
    return choices, kinds


@pytest.mark.parametrize("package", sorted(_views()))
def test_a_views_fields_have_their_keys_types_and_choices(package: str) -> None:
    declared = declared_keys(package)
    for name, (path, hint) in view_keys(_views()[package], declared).items():
        assert actual_hint(hint) == expected_hint(declared[name]), (package, path)


def _leaves(view: object) -> dict[str, object]:
    """Each leaf of a built view by its dotted path, lists as tuples."""
    return {path: tuple(v) if isinstance(v, list) else v for path, v in _fields(view).items()}


def _other_value(key: epl.ConfigKey) -> Any:
    """A valid value of ``key`` other than its default."""
    candidates: list[Any] = [*(key.choices or ()), True, False, 7, 7.5, "x", ["x"], None]
    return next(c for c in candidates if c != key.default and key.problem_with(c) is None)


@pytest.mark.parametrize("package", sorted(_views()))
def test_a_views_field_holds_its_own_keys_value(package: str) -> None:
    """Each key set alone to another value changes its field and no other (no two reads swapped)."""
    view = _views()[package]
    declared = declared_keys(package)
    defaults = _leaves(view.read(epl.Config({}, environ={})))  # type: ignore[attr-defined]
    for name, (path, _) in view_keys(view, declared).items():
        other = _other_value(declared[name])
        built = _leaves(view.read(epl.Config({name: other}, environ={})))  # type: ignore[attr-defined]
        expected = {**defaults, path: tuple(other) if isinstance(other, list) else other}
        assert built == expected, (package, name)


@dataclasses.dataclass(frozen=True)
class _WrongSection:
    """A ``zero`` section with a mistyped field (``str``, not the ``Literal`` of the choices) and an undeclared one."""

    level: str = ""
    extra: int = 0


@dataclasses.dataclass(frozen=True)
class _WrongView:
    """A view missing most of ``zero.*``, with a field at the top that is no key's attribute."""

    zero: _WrongSection = dataclasses.field(default_factory=_WrongSection)
    nothing: int = 0


def test_the_view_checks_see_a_missing_an_extra_and_a_mistyped_field() -> None:
    declared = {name: key for name, key in declared_keys("epl-memory").items() if name.startswith("zero.")}
    with pytest.raises(AssertionError, match="_WrongView.nothing names no one declared key"):
        view_keys(_WrongView, declared)
    named = view_keys(_WrongView, {**declared, "other.nothing": declared["zero.level"]})
    assert sorted(named) == ["other.nothing", "zero.extra", "zero.level"]
    assert not set(declared) <= set(named) and "zero.extra" not in declared
    assert actual_hint(named["zero.level"][1]) != expected_hint(declared["zero.level"])


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
