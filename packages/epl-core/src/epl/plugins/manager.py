"""A typed facade over pluggy: one method per hook, entry-point discovery, validation."""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.metadata
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import pluggy

from epl.errors import MissingPluginError, PluginError
from epl.interfaces.config_key import ConfigKey
from epl.interfaces.phases import TransformPhase, WrapperPhase
from epl.plugins import hookspecs

if TYPE_CHECKING:
    import click
    from torch import nn

    from epl.annotations.taskgraph import TaskGraph
    from epl.config import Config
    from epl.interfaces.cluster import Cluster
    from epl.interfaces.communicator import Communicator
    from epl.interfaces.schedule import ScheduleGenerator
    from epl.interfaces.split_rule import SplitRule
    from epl.placement.memory_estimate import MemoryEstimate, ShardShapes
    from epl.placement.plan import Plan
    from epl.placement.plan_memory import MemoryEstimateContext
    from epl.plugins.context import (
        GradientReducer,
        LossScaler,
        ModelTransform,
        OptimizerWrapper,
        ParallelContext,
        StepRunner,
    )

#: Entry-point group that plugins are discovered in.
ENTRY_POINT_GROUP = "epl"
#: ``1``/``true`` blocks every external plugin; a comma-separated list blocks those names.
DISABLE_ENV_VAR = "EPL_DISABLE_EXTERNAL_PLUGINS"
#: The name the core's own plugin is registered under.
CORE_PLUGIN_NAME = "epl-core"
#: The module of the core's own plugin (the built-in layer, above this one). It is loaded by name, as an
#: entry point would be, so that the plugin layer does not import the built-ins it registers.
CORE_PLUGIN_MODULE = "epl.builtin.plugin"


class _Phased(Protocol):
    """A model transform or an optimizer wrapper: something run in the order of its phase (an IntEnum)."""

    @property
    def phase(self) -> int:
        """When it runs, by the phases of :mod:`epl.interfaces.phases`."""
        ...


T = TypeVar("T", bound=_Phased)


@dataclass(frozen=True)
class PluginInfo:
    """What ``epl plugins`` shows about one registered plugin."""

    name: str
    source: str
    hooks: tuple[str, ...]


class EplPluginManager:
    """The plugins of this process and one typed method per hook.

    The core's defaults are registered first as the ``epl-core`` plugin; then
    every entry point of the ``epl`` group is loaded, unless blocked by
    ``EPL_DISABLE_EXTERNAL_PLUGINS``. Every implementation must match a spec.
    """

    def __init__(self, *, load_entry_points: bool = True, environ: Mapping[str, str] | None = None) -> None:
        builtin = importlib.import_module(CORE_PLUGIN_MODULE)

        self._pm = pluggy.PluginManager("epl")
        self._pm.add_hookspecs(hookspecs)
        self._sources: dict[str, str] = {}
        self._schema: dict[str, ConfigKey] | None = None
        self.blocked: tuple[str, ...] = ()
        self.register(builtin, name=CORE_PLUGIN_NAME, source="built in")
        if load_entry_points:
            self._load_entry_points(os.environ if environ is None else environ)

    # -- registration --------------------------------------------------------------
    def register(self, plugin: object, *, name: str, source: str = "registered in code") -> None:
        """Register ``plugin`` (a module or object with ``@epl.hookimpl`` functions) as ``name``."""
        if self._pm.has_plugin(name):
            raise PluginError(f"A plugin named {name!r} is already registered ({self._sources[name]}).")
        try:
            self._pm.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"Plugin {name!r} ({source}) does not match EPL's hook specs: {exc}") from exc
        self._check_specs(name)
        self._sources[name] = source
        self._schema = None

    def unregister(self, name: str) -> None:
        """Remove the plugin registered as ``name``."""
        self._pm.unregister(name=name)
        self._sources.pop(name, None)
        self._schema = None

    def has_plugin(self, name: str) -> bool:
        """Whether a plugin is registered under ``name`` (a distribution name for entry points)."""
        return self._pm.has_plugin(name)

    def plugins(self) -> list[PluginInfo]:
        """Every registered plugin with where it came from and the hooks it implements."""
        infos = []
        for name, plugin in self._pm.list_name_plugin():
            hooks = tuple(sorted(caller.name for caller in self._pm.get_hookcallers(plugin) or []))
            infos.append(PluginInfo(name=name, source=self._sources.get(name, "?"), hooks=hooks))
        return infos

    def _load_entry_points(self, environ: Mapping[str, str]) -> None:
        setting = environ.get(DISABLE_ENV_VAR, "").strip()
        block_all = setting.lower() in {"1", "true", "yes", "all"}
        names = {n.strip() for n in setting.split(",") if n.strip()} if not block_all else set()
        blocked = []
        for dist in importlib.metadata.distributions():
            for entry_point in dist.entry_points:
                if entry_point.group != ENTRY_POINT_GROUP or self._pm.has_plugin(entry_point.name):
                    continue
                if block_all or entry_point.name in names:
                    blocked.append(entry_point.name)
                    continue
                source = f"{dist.metadata['Name']} {dist.version}"
                try:
                    plugin = entry_point.load()
                except Exception as exc:
                    raise PluginError(
                        f"Plugin {entry_point.name!r} ({source}, entry point {entry_point.value}) "
                        f"failed to import: {exc!r}. Fix or uninstall it, or set "
                        f"{DISABLE_ENV_VAR}={entry_point.name} to skip it."
                    ) from exc
                self.register(plugin, name=entry_point.name, source=source)
        self.blocked = tuple(sorted(set(blocked)))

    def _check_specs(self, name: str) -> None:
        plugin = self._pm.get_plugin(name)
        for caller in self._pm.get_hookcallers(plugin) or []:
            if caller.spec is None:
                known = [n for n in dir(hookspecs) if n.startswith("epl_")]
                match = difflib.get_close_matches(caller.name, known, n=1)
                hint = f" Did you mean {match[0]!r}?" if match else ""
                self._pm.unregister(name=name)
                raise PluginError(
                    f"Plugin {name!r} implements {caller.name!r}, which is not an EPL hook.{hint} "
                    f"The hooks are listed in epl/plugins/hookspecs.py."
                )

    # -- one method per hook -------------------------------------------------------
    def config_schema(self) -> dict[str, ConfigKey]:
        """Every declared config key by name (``epl_config_keys`` of all plugins)."""
        if self._schema is None:
            self._schema = self._collect_config_keys()
        return self._schema

    def _collect_config_keys(self) -> dict[str, ConfigKey]:
        schema: dict[str, ConfigKey] = {}
        owners: dict[str, str] = {}
        # Core first, so that a clash names the core's key as the first one.
        impls = sorted(
            self._pm.hook.epl_config_keys.get_hookimpls(),
            key=lambda impl: impl.plugin_name != CORE_PLUGIN_NAME,
        )
        for impl in impls:
            returned = cast("Iterable[object] | None", impl.function())  # pluggy types it as object
            for key in returned or ():
                if not isinstance(key, ConfigKey):
                    raise PluginError(
                        f"Plugin {impl.plugin_name!r} returned {key!r} from epl_config_keys; "
                        "it must return epl.ConfigKey objects."
                    )
                if key.name in schema:
                    raise PluginError(
                        f"Config key {key.name!r} is declared by both {owners[key.name]!r} and "
                        f"{impl.plugin_name!r}. Rename one of them."
                    )
                if impl.plugin_name != CORE_PLUGIN_NAME and key.provided_by is None:
                    key = dataclasses.replace(key, provided_by=impl.plugin_name)
                schema[key.name] = key
                owners[key.name] = impl.plugin_name
        return dict(sorted(schema.items()))

    def config_facts(self, config: Config) -> dict[type, object]:
        """Every typed fact the plugins build from ``config`` (``epl_config_facts``), by its type."""
        built: dict[type, object] = {}
        for records in self._pm.hook.epl_config_facts(config=config):
            for record in records or ():
                if type(record) in built:
                    raise PluginError(f"Two plugins describe {type(record).__name__} (epl_config_facts): keep one.")
                built[type(record)] = record
        return built

    def make_communicator(self, cluster: Cluster, config: Config) -> Communicator:
        """The communicator for ``cluster`` (``epl_make_communicator``)."""
        communicator: Communicator | None = self._pm.hook.epl_make_communicator(cluster=cluster, config=config)
        if communicator is None:
            raise MissingPluginError(
                f"No installed plugin can join {cluster.world_size} processes: the core only runs "
                "one process. Install the package epl-comm: pip install epl-comm "
                "(from a checkout: pip install -e packages/epl-comm)."
            )
        return communicator

    def model_transforms(self, context: ParallelContext) -> list[ModelTransform]:
        """Every applicable model transform, by phase then name (``epl_model_transforms``)."""
        return _by_phase(self._pm.hook.epl_model_transforms(context=context), TransformPhase, "model transform")

    def optimizer_wrappers(self, context: ParallelContext) -> list[OptimizerWrapper]:
        """Every applicable optimizer wrapper, by phase then name (``epl_optimizer_wrappers``)."""
        return _by_phase(self._pm.hook.epl_optimizer_wrappers(context=context), WrapperPhase, "optimizer wrapper")

    def partition_model(
        self, model: nn.Module, taskgraphs: list[TaskGraph], config: Config, example_inputs: Any = None
    ) -> list[TaskGraph]:
        """The TaskGraphs to plan with: a plugin's automatic partition, or the annotated ones."""
        partitioned = self._pm.hook.epl_partition_model(
            model=model, taskgraphs=taskgraphs, config=config, example_inputs=example_inputs
        )
        return taskgraphs if partitioned is None else partitioned

    def make_gradient_reducer(self, context: ParallelContext) -> GradientReducer | None:
        """What reduces gradients over parameter copies, or None (``epl_make_gradient_reducer``)."""
        reducer: GradientReducer | None = self._pm.hook.epl_make_gradient_reducer(context=context)
        return reducer

    def make_loss_scaler(self, context: ParallelContext) -> LossScaler | None:
        """What scales the loss and skips non-finite steps (AMP), or None (``epl_make_loss_scaler``)."""
        scaler: LossScaler | None = self._pm.hook.epl_make_loss_scaler(context=context)
        return scaler

    def make_step_runner(self, context: ParallelContext) -> StepRunner:
        """What ``Engine.step`` runs on this rank (``epl_make_step_runner``)."""
        runner: StepRunner | None = self._pm.hook.epl_make_step_runner(context=context)
        if runner is None:
            raise MissingPluginError(
                f"No installed plugin can run a plan with {context.plan.num_stages} pipeline stages. "
                "Install the package epl-pipeline: pip install epl-pipeline "
                "(from a checkout: pip install -e packages/epl-pipeline)."
            )
        return runner

    def estimate_shards(self, model: nn.Module, taskgraphs: list[TaskGraph], plan: Plan) -> ShardShapes | None:
        """What each device of the split ``taskgraphs`` would hold (``epl_estimate_shards``), or None."""
        shapes: ShardShapes | None = self._pm.hook.epl_estimate_shards(
            model=model, taskgraphs=taskgraphs, plan=plan, split_rules=self.split_rules()
        )
        return shapes

    def adjust_memory_estimate(self, estimate: MemoryEstimate, context: MemoryEstimateContext) -> MemoryEstimate:
        """``estimate`` after every plugin's ``epl_adjust_memory_estimate``, applied in turn."""
        from epl.placement.memory_estimate import MemoryEstimate

        arguments = {"estimate": estimate, "context": context}
        for impl in reversed(self._pm.hook.epl_adjust_memory_estimate.get_hookimpls()):  # pluggy's call order
            arguments["estimate"] = estimate
            adjusted = impl.function(*(arguments[name] for name in impl.argnames))
            if adjusted is None:
                continue
            if not isinstance(adjusted, MemoryEstimate):
                raise PluginError(
                    f"Plugin {impl.plugin_name!r} returned {adjusted!r} from epl_adjust_memory_estimate; "
                    "it must return an epl.plugin_api.MemoryEstimate or None."
                )
            estimate = adjusted
        return estimate

    def pipeline_schedules(self) -> dict[str, ScheduleGenerator]:
        """Every registered pipeline schedule by name (``epl_pipeline_schedules``)."""
        return self._registry(self._pm.hook.epl_pipeline_schedules, "pipeline schedule", str)

    def split_rules(self) -> dict[type[nn.Module], SplitRule]:
        """Every registered split rule by module type (``epl_split_rules``); a plugin's rule replaces the core's."""
        return self._registry(
            self._pm.hook.epl_split_rules, "split rule for", lambda t: t.__qualname__, core_yields=True
        )

    def add_cli_commands(self, cli: click.Group) -> None:
        """Let every plugin add its subcommands to ``cli`` (``epl_cli_commands``)."""
        self._pm.hook.epl_cli_commands(cli=cli)

    def _registry(
        self, hook: Any, what: str, describe: Callable[[Any], str], *, core_yields: bool = False
    ) -> dict[Any, Any]:
        """Merge every plugin's entries; the same key twice is an error (``core_yields``: unless one is the core's)."""
        merged: dict[Any, Any] = {}
        owners: dict[Any, str] = {}
        impls = sorted(hook.get_hookimpls(), key=lambda impl: impl.plugin_name != CORE_PLUGIN_NAME)
        for impl in impls:
            for key, value in (impl.function() or {}).items():
                if key in merged and not (core_yields and owners[key] == CORE_PLUGIN_NAME):
                    raise PluginError(
                        f"The {what} {describe(key)!r} is registered by both {owners[key]!r} and "
                        f"{impl.plugin_name!r}. Uninstall or rename one of them."
                    )
                merged[key] = value
                owners[key] = impl.plugin_name
        return merged


def _by_phase(results: Iterable[Iterable[T] | None], phases: type[TransformPhase | WrapperPhase], what: str) -> list[T]:
    """Every item of every plugin's result, sorted by phase, then name (ties cannot depend on install order)."""
    items = [item for result in results for item in (result or ())]
    for item in items:
        if not isinstance(getattr(item, "phase", None), phases):
            raise PluginError(
                f"The {what} {getattr(item, 'name', item)!r} has no valid phase (got "
                f"{getattr(item, 'phase', None)!r}); give it a phase = epl.plugin_api.{phases.__name__}.<one of "
                f"{', '.join(phases.__members__)}>."
            )
    return sorted(items, key=lambda item: (item.phase, str(getattr(item, "name", ""))))
