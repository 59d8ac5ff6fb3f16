"""Plugin discovery through entry points, hook validation, and the core's hooks used by plugins."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import epl
from epl.cli import make_cli
from epl.config import ConfigKey
from epl.plugin_api import TransformPhase, WrapperPhase
from epl.plugins import EplPluginManager, get_plugin_manager

FAKE_PLUGIN = '''
import click
import epl
from epl.config import ConfigKey

@epl.hookimpl
def epl_config_keys():
    return [ConfigKey(name="fake.level", types=(int,), default=0, minimum=0, doc="A key of the fake plugin.")]

@epl.hookimpl
def epl_cli_commands(cli):
    @cli.command("fake")
    def fake():
        """Say hello from the fake plugin."""
        click.echo("hello from fake")
'''


def install_fake_distribution(root: Path, name: str, module: str, source: str) -> None:
    """A real (unpacked) distribution on sys.path with an ``epl`` entry point."""
    (root / f"{module}.py").write_text(source)
    info = root / f"{module}-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.2.3\n")
    (info / "entry_points.txt").write_text(f"[epl]\n{name} = {module}\n")


@pytest.fixture
def fake_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    install_fake_distribution(tmp_path, "epl-fake", "epl_fake_plugin", FAKE_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "epl-fake"
    sys.modules.pop("epl_fake_plugin", None)


def test_core_defaults_are_a_plugin() -> None:
    (info,) = [p for p in get_plugin_manager().plugins() if p.name == "epl-core"]
    assert info.source == "built in"
    assert {"epl_config_keys", "epl_make_communicator", "epl_make_step_runner", "epl_cli_commands"} <= set(info.hooks)


def test_entry_point_plugin_is_discovered(fake_plugin: str) -> None:
    manager = get_plugin_manager()
    assert manager.has_plugin(fake_plugin)
    (info,) = [p for p in manager.plugins() if p.name == fake_plugin]
    assert info.source == "epl-fake 1.2.3" and info.hooks == ("epl_cli_commands", "epl_config_keys")
    assert epl.Config({"fake.level": 3})["fake.level"] == 3
    result = CliRunner().invoke(make_cli(), ["fake"])
    assert result.output == "hello from fake\n", (result.output, result.exception)
    assert "epl-fake (epl-fake 1.2.3)" in CliRunner().invoke(make_cli(), ["plugins"]).output.replace("  ", " ")


@pytest.mark.parametrize("setting", ["1", "true", "epl-fake", "other,epl-fake"])
def test_external_plugins_can_be_disabled(fake_plugin: str, monkeypatch: pytest.MonkeyPatch, setting: str) -> None:
    monkeypatch.setenv("EPL_DISABLE_EXTERNAL_PLUGINS", setting)
    manager = EplPluginManager()
    assert not manager.has_plugin(fake_plugin) and manager.has_plugin("epl-core")
    assert fake_plugin in manager.blocked
    with pytest.raises(epl.ConfigError, match="Unknown config key 'fake.level'"):
        epl.Config({"fake.level": 1}, plugin_manager=manager)


def test_plugin_that_fails_to_import_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    install_fake_distribution(tmp_path, "epl-broken", "epl_broken_plugin", "raise ImportError('no torch_xla here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        epl.PluginError,
        match=r"Plugin 'epl-broken' \(epl-broken 1.2.3.*failed to import.*no torch_xla here"
        r".*EPL_DISABLE_EXTERNAL_PLUGINS=epl-broken",
    ):
        EplPluginManager()


def test_implementation_without_spec_is_rejected_with_suggestion() -> None:
    class Typo:
        @epl.hookimpl
        def epl_config_key(self) -> list[ConfigKey]:
            return []

    manager = EplPluginManager(load_entry_points=False)
    with pytest.raises(
        epl.PluginError, match=r"implements 'epl_config_key', which is not an EPL hook. Did you mean 'epl_config_keys'"
    ):
        manager.register(Typo(), name="typo")
    assert not manager.has_plugin("typo")


def test_implementation_with_wrong_arguments_is_rejected() -> None:
    class Wrong:
        @epl.hookimpl
        def epl_make_communicator(self, cluster, config, extra):  # type: ignore[no-untyped-def]
            return None

    with pytest.raises(epl.PluginError, match="does not match EPL's hook specs"):
        EplPluginManager(load_entry_points=False).register(Wrong(), name="wrong")


def test_duplicate_config_key_is_an_error() -> None:
    class Clash:
        @epl.hookimpl
        def epl_config_keys(self) -> list[ConfigKey]:
            return [ConfigKey(name="pipeline.num_micro_batch", types=(int,), default=2, doc="clash")]

    manager = EplPluginManager(load_entry_points=False)
    manager.register(Clash(), name="clash")
    with pytest.raises(epl.PluginError, match="'pipeline.num_micro_batch' is declared by both 'epl-core' and 'clash'"):
        manager.config_schema()


def test_providing_plugin_may_refine_its_key_and_satisfies_the_requirement(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPL_DISABLE_EXTERNAL_PLUGINS", "epl-memory")  # the real one stands aside

    class Memory:
        @epl.hookimpl
        def epl_config_keys(self) -> list[ConfigKey]:
            return [ConfigKey(name="zero.level", types=(str,), default="", choices=("", "v1", "v3"), doc="refined")]

    manager = get_plugin_manager()
    with pytest.raises(epl.MissingPluginError):
        epl.init(epl.Config({"zero.level": "v1"}))
    manager.register(Memory(), name="epl-memory")
    config = epl.Config({"zero.level": "v3"})
    assert epl.init(config).config["zero.level"] == "v3"


def test_registries_reject_duplicates() -> None:
    def schedule(stages: int, micro_batches: int) -> list[list[None]]:
        return [[None]] * stages

    def keep(module: nn.Module, shard: epl.ShardContext) -> nn.Module:
        return module

    class A:
        @epl.hookimpl
        def epl_pipeline_schedules(self):  # type: ignore[no-untyped-def]
            return {"Mine": schedule}

        @epl.hookimpl
        def epl_split_rules(self):  # type: ignore[no-untyped-def]
            return {nn.Linear: keep}

    class B(A):
        pass

    manager = EplPluginManager(load_entry_points=False)
    manager.register(A(), name="a")
    assert manager.pipeline_schedules() == {"Mine": schedule}
    assert manager.split_rules()[nn.Linear] is keep  # a plugin's rule replaces the core's
    manager.register(B(), name="b")
    with pytest.raises(epl.PluginError, match="pipeline schedule 'Mine' is registered by both"):
        manager.pipeline_schedules()
    with pytest.raises(epl.PluginError, match="split rule for 'Linear' is registered by both"):
        manager.split_rules()


def test_model_transforms_and_optimizer_wrappers_run_in_order() -> None:
    calls: list[str] = []

    class Scale:
        def __init__(self, name: str, phase: TransformPhase) -> None:
            self.name, self.phase = name, phase

        def __call__(self, model: nn.Module, context: object) -> nn.Module:
            calls.append(self.name)
            return model

    class Wrap:
        name, phase = "wrap", WrapperPhase.PARTITION_OPTIMIZER

        def __call__(self, optimizer: torch.optim.Optimizer, context: object) -> torch.optim.Optimizer:
            calls.append("wrap")
            assert isinstance(context, epl.runtime.ParallelContext) and context.optimizer is optimizer
            return optimizer

    class Plugin:
        @epl.hookimpl
        def epl_model_transforms(self, context):  # type: ignore[no-untyped-def]
            assert context.plan.local
            return [Scale("second", TransformPhase.CAST), Scale("first", TransformPhase.SHARD)]

        @epl.hookimpl
        def epl_optimizer_wrappers(self, context):  # type: ignore[no-untyped-def]
            return [Wrap()]

    get_plugin_manager().register(Plugin(), name="ordering")
    epl.init()
    epl.parallelize(nn.Linear(2, 2), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    assert calls == ["first", "second", "wrap"]


def test_transforms_run_by_phase_then_name_and_need_a_phase() -> None:
    calls: list[str] = []

    class Step:
        def __init__(self, name: str, phase: object) -> None:
            self.name, self.phase = name, phase

        def __call__(self, model: nn.Module, context: object) -> nn.Module:
            calls.append(self.name)
            return model

    steps = [
        Step("z-first", TransformPhase.KEEP_STAGE),
        Step("b", TransformPhase.OFFLOAD),
        Step("a", TransformPhase.OFFLOAD),
    ]

    class Plugin:
        @epl.hookimpl
        def epl_model_transforms(self, context):  # type: ignore[no-untyped-def]
            return steps

    get_plugin_manager().register(Plugin(), name="phases")
    epl.init()
    epl.parallelize(nn.Linear(2, 2))
    assert calls == ["z-first", "a", "b"]  # the phase first, then the name: never the order plugins returned them

    steps[:] = [Step("numbered", 100)]
    epl.init()
    with pytest.raises(epl.PluginError, match=r"'numbered' has no valid phase.*TransformPhase"):
        epl.parallelize(nn.Linear(2, 2))


def test_a_plugin_step_runner_overrides_the_core() -> None:
    class Runner:
        def step(self, inputs: object, targets: object = None) -> torch.Tensor:
            return torch.tensor(42.0)

    class Plugin:
        @epl.hookimpl
        def epl_make_step_runner(self, context):  # type: ignore[no-untyped-def]
            return Runner()

    get_plugin_manager().register(Plugin(), name="runner")
    epl.init()
    engine = epl.parallelize(nn.Linear(2, 2), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    assert engine.step(torch.zeros(1, 2)).item() == 42.0


@pytest.mark.usefixtures("core_only")
def test_several_processes_without_epl_comm_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(epl.MissingPluginError, match="can join 2 processes.*pip install epl-comm"):
        epl.init()


def test_every_hook_is_documented_and_exercised() -> None:
    from epl.plugins import hookspecs

    hooks = [name for name in dir(hookspecs) if name.startswith("epl_")]
    assert len(hooks) == 14
    source = Path(__file__).read_text()
    for name in hooks:
        assert (getattr(hookspecs, name).__doc__ or "").strip(), f"{name} has no docstring"
        assert name in source, f"{name} is not exercised by a test in this file"


def test_a_plugin_estimates_the_shards_of_split_taskgraphs() -> None:
    """epl_estimate_shards: the Plan's memory comes from the answering plugin, not from the core's rules."""
    seen: list[tuple[int, bool]] = []

    class Thirds:  # every device holds a third of every parameter, whatever the rule would do
        def __init__(self, model: nn.Module, taskgraphs: list) -> None:  # type: ignore[type-arg]
            self.model, self.taskgraphs = model, taskgraphs

        def pieces(self, taskgraph: int, position: int) -> dict[int, tuple[int, list]]:  # type: ignore[type-arg]
            names = {id(p): n for n, p in self.model.named_parameters()}
            split = next(tg for tg in self.taskgraphs if tg.index == taskgraph)
            return {
                id(p): (i, [(names[id(p)], torch.empty(p.numel() // 3, device="meta"), True)])
                for i, p in enumerate(split.parameters)
            }

    class Plugin:
        @epl.hookimpl
        def epl_estimate_shards(self, model, taskgraphs, plan, split_rules):  # type: ignore[no-untyped-def]
            seen.append((len(taskgraphs), nn.Linear in split_rules))
            return Thirds(model, taskgraphs)

    get_plugin_manager().register(Plugin(), name="thirds")
    epl.init()
    with epl.split(2):
        model = nn.Sequential(nn.Linear(8, 6))  # the core's rule would give shards of 3 x 8 + 3
    plan = epl.plan(model, world_size=2)
    assert seen == [(1, True)]
    assert [m.parameter_bytes for m in plan.memory] == [(16 + 2) * 4] * 2


def test_a_partition_plugin_replaces_the_taskgraphs_before_the_plan() -> None:
    from epl.annotations.strategies import replicate
    from epl.annotations.taskgraph import TaskGraph

    class Halves:
        @epl.hookimpl
        def epl_partition_model(self, model, taskgraphs, config):  # type: ignore[no-untyped-def]
            assert [tg.implicit for tg in taskgraphs] == [True]
            return [
                TaskGraph(index=i, strategy=replicate(1, name=f"half_{i}"), tensors=list(layer.parameters()))
                for i, layer in enumerate(model)
            ]

    get_plugin_manager().register(Halves(), name="halves")
    epl.init()
    plan = epl.plan(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), world_size=4)
    assert [tg.name for tg in plan.taskgraphs] == ["half_0", "half_1"]
    assert plan.num_stages == 2 and plan.num_replicas == 2


def test_gradient_reducer_finishes_every_step_and_receives_the_clip() -> None:
    calls: list[str] = []

    class Reducer:
        def start(self) -> None:
            calls.append("start")

        def finish(self, clip):  # type: ignore[no-untyped-def]
            calls.append("finish")
            assert clip is not None
            clip()

    class Plugin:
        @epl.hookimpl
        def epl_make_gradient_reducer(self, context):  # type: ignore[no-untyped-def]
            return Reducer()

    get_plugin_manager().register(Plugin(), name="reducer")
    epl.init(epl.Config({"optimizer.max_grad_norm": 0.5}))
    model = nn.Linear(2, 2)
    engine = epl.parallelize(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.0), loss_fn=nn.MSELoss())
    engine.step(torch.full((4, 2), 10.0), torch.zeros(4, 2))
    engine.step(torch.full((4, 2), 10.0), torch.zeros(4, 2))
    assert calls == ["start", "finish", "start", "finish"]
    norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    assert norm <= 0.5 + 1e-6


def test_a_loss_scaler_plugin_unscales_before_clipping_once_and_may_skip_the_update() -> None:
    calls: list[str] = []

    class Scaler:
        scale = 4.0
        skip = False
        unscaled = False

        def start(self) -> None:
            calls.append("start")
            self.unscaled = False

        def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
            calls.append("scale")
            return loss * self.scale

        def unscale(self, params):  # type: ignore[no-untyped-def]
            calls.append("unscale")
            if not self.unscaled:
                self.unscaled = True
                for param in params:
                    param.grad.div_(self.scale)

        def update(self, params):  # type: ignore[no-untyped-def]
            calls.append("update")
            return not self.skip

        def state_dict(self) -> dict[str, float]:
            return {"scale": self.scale}

        def load_state_dict(self, state: dict[str, float]) -> None:
            self.scale = state["scale"]

    scaler = Scaler()

    class Plugin:
        @epl.hookimpl
        def epl_make_loss_scaler(self, context):  # type: ignore[no-untyped-def]
            return scaler

    get_plugin_manager().register(Plugin(), name="scaler")
    epl.init(epl.Config({"optimizer.max_grad_norm": 0.5, "pipeline.num_micro_batch": 2}))
    torch.manual_seed(0)
    model, plain = nn.Linear(2, 2), nn.Linear(2, 2)
    plain.load_state_dict(model.state_dict())
    engine = epl.parallelize(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.MSELoss())
    assert engine.loss_scaler is scaler
    x, y = torch.full((4, 2), 10.0), torch.zeros(4, 2)
    loss = engine.step(x, y)
    # each micro-batch's loss scaled; unscaled before the clip (the second call is a no-op), then the decision
    assert calls == ["start", "scale", "scale", "unscale", "unscale", "update"]
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    losses = []
    for xm, ym in zip(x.chunk(2), y.chunk(2), strict=True):
        losses.append(nn.functional.mse_loss(plain(xm), ym))
        (losses[-1] / 2).backward()
    torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
    optimizer.step()
    assert torch.equal(loss, torch.stack(losses).detach().mean())  # the unscaled loss
    for ours, theirs in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(ours, theirs)  # the true gradients were clipped, once
    scaler.skip = True
    before = [p.detach().clone() for p in model.parameters()]
    engine.step(x, y)
    assert all(torch.equal(p, b) and p.grad is None for p, b in zip(model.parameters(), before, strict=True))
    assert engine.state_dict()["loss_scaler"] == {"scale": 4.0}


def test_config_keys_hook_must_return_config_keys() -> None:
    class Wrong:
        @epl.hookimpl
        def epl_config_keys(self):  # type: ignore[no-untyped-def]
            return ["pipeline.foo"]

    manager = EplPluginManager(load_entry_points=False)
    manager.register(Wrong(), name="wrong")
    with pytest.raises(epl.PluginError, match="Plugin 'wrong' returned 'pipeline.foo' from epl_config_keys"):
        manager.config_schema()


def test_memory_estimate_adjustments_apply_in_turn() -> None:
    """epl_adjust_memory_estimate: each plugin gets the previous one's estimate; None leaves it; junk is an error."""
    import dataclasses

    class Halve:
        @epl.hookimpl
        def epl_adjust_memory_estimate(self, estimate, context):  # type: ignore[no-untyped-def]
            assert context.tensors and context.copies(context.tensors[0]).devices == (0, 1)
            return dataclasses.replace(estimate, gradient_bytes=estimate.gradient_bytes // 2, notes=("halved",))

    class Note:
        @epl.hookimpl(tryfirst=True)  # called first: sees the core's estimate
        def epl_adjust_memory_estimate(self, estimate):  # type: ignore[no-untyped-def]
            return dataclasses.replace(estimate, gradient_bytes=estimate.gradient_bytes + 2)

    class Quiet:
        @epl.hookimpl
        def epl_adjust_memory_estimate(self, estimate, context):  # type: ignore[no-untyped-def]
            return None

    manager = get_plugin_manager()
    for plugin, name in ((Halve(), "halve"), (Note(), "note"), (Quiet(), "quiet")):
        manager.register(plugin, name=name)
    epl.init()
    memory = epl.plan(nn.Linear(3, 2), world_size=2).memory
    halved = (32 + 2) // 2  # Note first (tryfirst), then Halve; Quiet changes nothing
    assert [(m.rank, m.gradient_bytes, m.notes) for m in memory] == [(0, halved, ("halved",)), (1, halved, ("halved",))]

    class Junk:
        @epl.hookimpl
        def epl_adjust_memory_estimate(self, estimate, context):  # type: ignore[no-untyped-def]
            return {"gradient_bytes": 0}

    manager.register(Junk(), name="junk")
    with pytest.raises(epl.PluginError, match="Plugin 'junk' returned .* from epl_adjust_memory_estimate"):
        epl.plan(nn.Linear(3, 2), world_size=2)


def test_a_plugin_describes_its_keys_as_typed_facts_once() -> None:
    """epl_config_facts: each record type comes from one plugin; two plugins describing one type is an error."""
    from dataclasses import dataclass

    from epl.plugins.manager import EplPluginManager

    @dataclass(frozen=True)
    class Tuning:
        fast: bool = False

    class Owner:
        @epl.hookimpl
        def epl_config_facts(self, config):  # type: ignore[no-untyped-def]
            return [Tuning(fast=config["pipeline.num_micro_batch"] > 1)]

    manager = EplPluginManager(load_entry_points=False)
    manager.register(Owner(), name="owner")
    config = epl.Config({"pipeline.num_micro_batch": 2})
    assert manager.config_facts(config) == {Tuning: Tuning(fast=True)}
    manager.register(Owner(), name="second")
    with pytest.raises(epl.PluginError, match="Two plugins describe Tuning"):
        manager.config_facts(config)


def test_the_engine_asks_runners_and_scalers_for_capabilities_by_protocol() -> None:
    """epl.plugin_api's capabilities are runtime_checkable: EPL's own runner and loss scaler have what they offer,
    and an object with only ``step`` has none of them."""
    from epl.plugin_api import (
        ChecksNonFiniteSteps,
        ClippingRunner,
        CountsSkippedSteps,
        EvaluatingRunner,
        FoldingLossScaler,
        LocalStepRunner,
        MeasurableRunner,
        PredictingRunner,
    )
    from epl_memory.amp import AmpLossScaler, AmpPolicy

    epl.init(epl.Config({}))
    engine = epl.parallelize(nn.Linear(2, 2), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.MSELoss())
    runner = engine.runner
    assert isinstance(runner, LocalStepRunner)
    for capability in (EvaluatingRunner, ClippingRunner, MeasurableRunner, ChecksNonFiniteSteps):
        assert isinstance(runner, capability), capability
    assert not isinstance(runner, PredictingRunner)
    scaler = AmpLossScaler(AmpPolicy.from_config(epl.Config({"amp.level": "O1"}), torch.device("cpu")))
    assert isinstance(scaler, CountsSkippedSteps) and isinstance(scaler, FoldingLossScaler)

    class OnlyStep:
        def step(self, inputs: object, targets: object = None) -> torch.Tensor:
            return torch.zeros(())

    for capability in (EvaluatingRunner, PredictingRunner, ClippingRunner, CountsSkippedSteps, FoldingLossScaler):
        assert not isinstance(OnlyStep(), capability)
    engine.runner = OnlyStep()  # type: ignore[assignment]
    with pytest.raises(epl.EplError, match="Engine.evaluate needs a step runner that evaluates"):
        engine.evaluate(torch.zeros(1, 2), torch.zeros(1, 2))


def test_a_loss_scaler_whose_skips_nobody_sees_is_refused() -> None:
    """Without a runner that checks non-finite steps, the engine learns of a skipped update only from the scaler's
    count: a scaler without one would let the LR scheduler step on skipped updates, so it is refused."""
    from epl.runtime.engine import Engine

    epl.init(epl.Config({}))
    engine = epl.parallelize(nn.Linear(2, 2), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.MSELoss())

    class OnlyStep:
        def step(self, inputs: object, targets: object = None) -> torch.Tensor:
            return torch.zeros(())

    class Silent:  # a third-party scaler with no skipped_steps
        scale = 1.0

    engine.context.loss_scaler = Silent()  # type: ignore[assignment]
    with pytest.raises(epl.PluginError, match="does not count the updates it skips"):
        Engine(engine.context, OnlyStep())  # type: ignore[arg-type]
    Engine(engine.context, engine.runner)  # EPL's runner checks non-finite steps itself: accepted
