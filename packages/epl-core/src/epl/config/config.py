"""``epl.Config``: validated values for every declared key, from a dict, a file and the environment."""

from __future__ import annotations

import difflib
import json
import os
import tomllib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

from epl.config.catalogue import KEY_OWNERS, owner_of
from epl.errors import ConfigError, MissingPluginError
from epl.interfaces.config_key import ConfigKey


class KeySource(Protocol):
    """Where a Config's keys come from: the plugin manager (``epl.plugins.EplPluginManager``) or a test's."""

    #: Plugins that are installed but blocked (``EPL_DISABLE_EXTERNAL_PLUGINS``).
    blocked: tuple[str, ...]

    def config_schema(self) -> Mapping[str, ConfigKey]:
        """Every declared key by name."""
        ...

    def has_plugin(self, name: str) -> bool:
        """Whether the plugin (distribution) ``name`` is registered."""
        ...


_default_source: Callable[[], KeySource] | None = None


def use_default_key_source(factory: Callable[[], KeySource]) -> None:
    """Set what ``Config(...)`` without ``plugin_manager=`` validates against (the process's plugin manager).

    The plugins layer calls this when it is imported (``import epl`` imports it), so the config
    layer never looks up plugins itself.
    """
    global _default_source
    _default_source = factory


def _default_key_source() -> KeySource:
    if _default_source is None:
        raise ConfigError(
            "No config keys are known yet: import epl (which loads the plugins) before building a Config."
        )
    return _default_source()


#: Environment variables of EPL's own that look like config keys but are not.
NON_KEY_ENV_VARS = frozenset({"EPL_CONFIG_FILE"})


class Config:
    """All EPL settings, validated against the keys the installed plugins declare.

    The keys come from ``plugin_manager`` (any :class:`KeySource`), by default the
    process's plugin manager. A key that no installed plugin declares but that belongs
    to a known package (:data:`epl.config.catalogue.KEY_OWNERS`, e.g. ``zero.level`` of
    epl-memory) is kept aside unvalidated; :meth:`check_plugins` (called by ``epl.init``)
    then fails with the package to install.

    Values come from, in increasing precedence: each key's default, a TOML or
    JSON file (``file=`` or the ``EPL_CONFIG_FILE`` variable), ``EPL_<SECTION>_<KEY>``
    environment variables, and ``param_dict``. Keys may be flat
    (``{"pipeline.num_micro_batch": 4}``) or nested by section
    (``{"pipeline": {"num_micro_batch": 4}}``).

    Read values as ``config["pipeline.num_micro_batch"]`` or
    ``config.pipeline.num_micro_batch``. A Config is read-only; build a new one with
    :meth:`with_overrides`.
    """

    # Set once in __init__ through object.__setattr__ (a Config is read-only); declared here so that attribute
    # reads of them are not taken for sections (__getattr__).
    _schema: dict[str, ConfigKey]
    _values: dict[str, Any]
    _sources: dict[str, str]
    _missing: dict[str, tuple[Any, str]]

    def __init__(
        self,
        param_dict: Mapping[str, Any] | None = None,
        *,
        file: str | os.PathLike[str] | None = None,
        environ: Mapping[str, str] | None = None,
        plugin_manager: KeySource | None = None,
    ) -> None:
        if plugin_manager is None:
            plugin_manager = _default_key_source()
        environ = os.environ if environ is None else environ
        schema = dict(plugin_manager.config_schema())
        values = {name: key.default for name, key in schema.items()}
        sources = dict.fromkeys(schema, "default")
        file = file if file is not None else environ.get("EPL_CONFIG_FILE") or None
        layers: list[tuple[str, Mapping[str, Any]]] = []
        if file is not None:
            layers.append(("file", _read_file(Path(file))))
        layers.append(("env", _from_environ(schema, environ, plugin_manager)))
        if param_dict is not None:
            layers.append(("dict", _flatten(param_dict, origin="the Config dict")))
        missing: dict[str, tuple[Any, str]] = {}
        for source, layer in layers:
            for name, value in layer.items():
                origin = _origin(source, name, file)
                owner = _absent_owner(name, schema, plugin_manager)
                if owner is not None:
                    missing[name] = (value, owner)
                    continue
                key = _lookup(schema, name, origin=origin)
                _check(key, value, origin=origin)
                values[name] = value
                sources[name] = source
        object.__setattr__(self, "_schema", schema)
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_sources", sources)
        object.__setattr__(self, "_missing", missing)

    # -- reading -------------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        if name in self._missing:
            raise MissingPluginError(_missing_line(name, *self._missing[name], blocked=False))
        _lookup(self._schema, name, origin="lookup")
        return self._values[name]

    def derived(self, name: str, build: Callable[[], Any]) -> Any:
        """``build()``, computed once per Config and kept under ``name`` (what plugins derive from these values)."""
        cache: dict[str, Any] = self.__dict__.setdefault("_derived", {})
        if name not in cache:
            cache[name] = build()
        return cache[name]

    def get(self, name: str, default: Any = None) -> Any:
        """The value of ``name``, or ``default`` when the package that declares it is not installed. A name no
        package declares (a typo) is a :class:`~epl.errors.ConfigError`, as with ``config[name]``."""
        if name in self._values:
            return self._values[name]
        owner = owner_of(name)
        if owner is None or any(owner_of(declared) == owner for declared in self._schema):  # not its package's
            _lookup(self._schema, name, origin="lookup")
        return default

    def __getattr__(self, section: str) -> _Section:
        if section.startswith("_"):
            raise AttributeError(section)
        names = [n for n in self._schema if n.split(".", 1)[0] == section]
        if not names:
            sections = sorted({n.split(".", 1)[0] for n in self._schema})
            hint = _closest(section, sections)
            raise AttributeError(f"Config has no section {section!r}.{hint} Sections: {', '.join(sections)}.")
        return _Section(self, section)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            "epl.Config is read-only; build a new one with epl.Config({...}) or config.with_overrides({...})"
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __contains__(self, name: object) -> bool:
        return name in self._values

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Config) and self._values == other._values

    def __hash__(self) -> int:
        return hash(tuple(sorted((k, repr(v)) for k, v in self._values.items())))

    def __repr__(self) -> str:
        changed = {k: v for k, v in self._values.items() if self._sources[k] != "default"}
        return f"epl.Config({changed!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self._schema, self._values, self._sources, self._missing))

    def keys(self) -> Mapping[str, ConfigKey]:
        """The declared keys, by name."""
        return dict(self._schema)

    def to_dict(self) -> dict[str, Any]:
        """Every key with its value, flat."""
        return dict(self._values)

    def source(self, name: str) -> str:
        """Where the value of ``name`` came from: default, file, env or dict."""
        _lookup(self._schema, name, origin="lookup")
        return self._sources[name]

    def with_overrides(self, overrides: Mapping[str, Any]) -> Config:
        """A new Config with ``overrides`` applied on top of this one (validated)."""
        values = dict(self._values)
        sources = dict(self._sources)
        for name, value in _flatten(overrides, origin="the overrides").items():
            _check(_lookup(self._schema, name, origin="override"), value)
            values[name] = value
            sources[name] = "dict"
        return _rebuild(self._schema, values, sources, self._missing)

    # -- plugin requirements -------------------------------------------------------
    def check_plugins(self, plugin_manager: KeySource) -> None:
        """Fail when a key that was set needs a plugin that is not installed (or is blocked)."""
        lines = [
            _missing_line(name, value, owner, blocked=owner in plugin_manager.blocked)
            for name, (value, owner) in self._missing.items()
            if not plugin_manager.has_plugin(owner)
        ]
        for name, key in self._schema.items():
            value = self._values[name]
            if key.provided_by is None or value == key.default:
                continue
            if plugin_manager.has_plugin(key.provided_by):
                continue
            lines.append(_missing_line(name, value, key.provided_by, blocked=key.provided_by in plugin_manager.blocked))
        if lines:
            raise MissingPluginError("\n".join(lines))


class _Section:
    """Attribute access to one section: ``config.pipeline.num_micro_batch``."""

    _config: Config
    _section: str

    def __init__(self, config: Config, section: str) -> None:
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_section", section)

    def __getattr__(self, attribute: str) -> Any:
        return self._config[f"{self._section}.{attribute}"]

    def __setattr__(self, attribute: str, value: Any) -> None:
        self._config.__setattr__(attribute, value)

    def __repr__(self) -> str:
        prefix = self._section + "."
        items = {k[len(prefix) :]: v for k, v in self._config.to_dict().items() if k.startswith(prefix)}
        return f"<epl.Config section {self._section}: {items}>"


def _rebuild(
    schema: dict[str, ConfigKey],
    values: dict[str, Any],
    sources: dict[str, str],
    missing: dict[str, tuple[Any, str]] | None = None,
) -> Config:
    config = Config.__new__(Config)
    object.__setattr__(config, "_schema", schema)
    object.__setattr__(config, "_values", values)
    object.__setattr__(config, "_sources", sources)
    object.__setattr__(config, "_missing", dict(missing or {}))
    return config


def _absent_owner(name: str, schema: Mapping[str, ConfigKey], source: KeySource) -> str | None:
    """The package that declares ``name`` when it is not declared here because that package is not registered."""
    if name in schema:
        return None
    owner = owner_of(name)
    return owner if owner is not None and not source.has_plugin(owner) else None


def _missing_line(name: str, value: Any, package: str, *, blocked: bool) -> str:
    if blocked:
        return (
            f"Config key {name!r} = {value!r} needs the plugin {package}, which is installed "
            "but blocked by EPL_DISABLE_EXTERNAL_PLUGINS. Unblock it, or do not set the key."
        )
    return (
        f"Config key {name!r} = {value!r} needs the package {package}, which is not installed. "
        f"Install it: pip install {package} (from a checkout: pip install -e packages/{package})."
    )


def _closest(name: str, candidates: list[str]) -> str:
    match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
    return f" Did you mean {match[0]!r}?" if match else ""


def _lookup(schema: Mapping[str, ConfigKey], name: str, *, origin: str) -> ConfigKey:
    key = schema.get(name)
    if key is None:
        where = "" if origin in ("lookup", "override") else f" (in {origin})"
        raise ConfigError(
            f"Unknown config key {name!r}{where}.{_closest(name, list(schema))} Run `epl config` to list every key."
        )
    return key


def _check(key: ConfigKey, value: Any, *, origin: str = "the Config dict") -> None:
    problem = key.problem_with(value)
    if problem is not None:
        where = "" if origin == "the Config dict" else f" (from {origin})"
        raise ConfigError(f"Invalid value for config key {key.name!r}{where}: {problem}. Allowed: {key.allowed()}.")


def _origin(source: str, name: str, file: object) -> str:
    if source == "file":
        return f"config file {file}"
    if source == "env":
        return "EPL_" + name.upper().replace(".", "_")
    return "the Config dict"


def _flatten(params: Mapping[str, Any], *, origin: str) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for name, value in params.items():
        if not isinstance(name, str):
            raise ConfigError(f"Config keys are strings like 'pipeline.num_micro_batch'; got {name!r} in {origin}.")
        if isinstance(value, Mapping) and "." not in name:
            for attribute, inner in value.items():
                flat[f"{name}.{attribute}"] = inner
        else:
            flat[name] = value
    return flat


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"Config file {path} does not exist.")
    text = path.read_text()
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        elif path.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            raise ConfigError(f"Config file {path} must end in .toml or .json.")
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"Config file {path} is not valid {path.suffix[1:].upper()}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"Config file {path} must hold a table of keys, got {type(data).__name__}.")
    return _flatten(data, origin=f"config file {path}")


def _from_environ(schema: Mapping[str, ConfigKey], environ: Mapping[str, str], source: KeySource) -> dict[str, Any]:
    by_var = {key.env_var: key for key in schema.values()}
    sections = {key.section for key in schema.values()} | {prefix.split(".", 1)[0] for prefix in KEY_OWNERS}
    section_prefixes = tuple(f"EPL_{section.upper()}_" for section in sections)
    absent = {
        f"EPL_{prefix.upper().replace('.', '_')}": prefix
        for prefix, owner in KEY_OWNERS.items()
        if not source.has_plugin(owner)
    }
    values: dict[str, Any] = {}
    for var, text in environ.items():
        if not var.startswith(section_prefixes) or var in NON_KEY_ENV_VARS:
            continue
        key = by_var.get(var)
        prefix = next((absent[p] for p in absent if var.startswith(p)), None) if key is None else None
        if prefix is not None:  # a key of a package that is not installed: check_plugins names the package
            values[_key_name_of(var, prefix)] = text
            continue
        if key is None:
            raise ConfigError(
                f"Environment variable {var} names no EPL config key.{_closest(var, list(by_var))} "
                "Run `epl config` to list every key and its variable."
            )
        try:
            values[key.name] = key.parse(text)
        except ValueError as exc:
            raise ConfigError(
                f"Invalid value for config key {key.name!r} from {var}={text!r}: {exc}. Allowed: {key.allowed()}."
            ) from None
    return values


def _key_name_of(var: str, prefix: str) -> str:
    """``zero.level`` for ``EPL_ZERO_LEVEL`` under prefix ``zero.`` (the rest of the name, lower case)."""
    if not prefix.endswith("."):
        return prefix
    return prefix + var[len("EPL_" + prefix) :].lower()
