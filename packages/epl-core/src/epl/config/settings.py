"""The core's own view of its config keys: frozen and typed, built once per :class:`~epl.config.Config`.

This module is the one place of epl-core that reads the core's keys by name (``tests/core/test_config_facts.py``
keeps it so); the rest of the core reads :class:`CoreSettings`' fields. The core's keys are the one set every
package may read, so plugins get this view too (``epl.plugin_api.CoreSettings``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from epl.config.view import ConfigView

if TYPE_CHECKING:
    from epl.config.config import Config


@dataclass(frozen=True)
class CorePipelineSettings:
    """The core's ``pipeline.*`` keys (the schedule's are epl-pipeline's)."""

    num_micro_batch: int = 1
    stages_per_rank: int = 1


@dataclass(frozen=True)
class OptimizerSettings:
    """The core's ``optimizer.*`` keys: clipping and non-finite steps (``num_apply_group`` is epl-memory's)."""

    max_grad_norm: float | None = None
    raise_after_skips: int | None = 20
    check_finite_gradients: bool = True


@dataclass(frozen=True)
class ClusterSettings:
    """The ``cluster.*`` keys: placement rules and the devices a rank sees."""

    colocate_split_and_replicate: bool = False
    device_place_prefer_intra_node: bool = True
    run_visible_devices: str = ""


@dataclass(frozen=True)
class CompileSettings:
    """The ``compile.*`` keys: torch.compile of the repeated blocks."""

    enabled: bool = False
    backend: str = "inductor"
    mode: str = ""


@dataclass(frozen=True)
class Float8Settings:
    """The ``float8.*`` keys: float8 training through torchao (:mod:`epl.float8`)."""

    enabled: bool = False
    recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    exclude: tuple[str, ...] = ()
    all_gather: bool = True


@dataclass(frozen=True)
class ContextSettings:
    """The ``context.*`` keys: context parallelism."""

    degree: int = 1
    mode: Literal["ring", "allgather", "ulysses"] = "ring"
    presliced: bool = False
    verify: bool = True


@dataclass(frozen=True)
class FitCheckSettings:
    """The ``fit_check.*`` keys: the prediction of each device's peak memory before the first step."""

    action: Literal["warn", "refuse"] = "warn"
    device: str = ""
    enabled: bool | Literal["auto"] = "auto"
    micro_batch_size: int | None = None
    sequence_length: int | None = None


@dataclass(frozen=True)
class IoSettings:
    """The ``io.*`` keys: file sharding and the batch checks."""

    check_batches: bool = True
    check_batches_every: int = 50
    drop_last_files: bool = False
    slicing: bool = False
    unbalanced_io_slicing: bool = False


@dataclass(frozen=True)
class ModelSettings:
    """The ``model.*`` keys."""

    meta_init: bool = False


@dataclass(frozen=True)
class PlannerSettings:
    """The ``planner.*`` keys: what ``auto.auto_parallel: "plan"`` plans for."""

    device: str = ""
    global_batch_size: int | None = None
    sequence_length: int | None = None


@dataclass(frozen=True)
class SplitSettings:
    """The ``split.*`` keys."""

    sequence_parallel: bool = False


@dataclass(frozen=True)
class CoreSettings(ConfigView):
    """Every key the core declares, by section: ``CoreSettings.from_config(config).optimizer.max_grad_norm``.

    Each field is named after its key (``<section>.<field>``); the keys' docs are in ``epl/config/catalogue.py``
    and ``epl config``.
    """

    pipeline: CorePipelineSettings = field(default_factory=CorePipelineSettings)
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    cluster: ClusterSettings = field(default_factory=ClusterSettings)
    compile: CompileSettings = field(default_factory=CompileSettings)
    context: ContextSettings = field(default_factory=ContextSettings)
    fit_check: FitCheckSettings = field(default_factory=FitCheckSettings)
    float8: Float8Settings = field(default_factory=Float8Settings)
    io: IoSettings = field(default_factory=IoSettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    planner: PlannerSettings = field(default_factory=PlannerSettings)
    split: SplitSettings = field(default_factory=SplitSettings)

    @classmethod
    def read(cls, config: Config) -> CoreSettings:
        """A new view of ``config``\'s values."""
        max_grad_norm = config["optimizer.max_grad_norm"]
        return cls(
            pipeline=CorePipelineSettings(
                num_micro_batch=config["pipeline.num_micro_batch"],
                stages_per_rank=config["pipeline.stages_per_rank"],
            ),
            optimizer=OptimizerSettings(
                max_grad_norm=None if max_grad_norm is None else float(max_grad_norm),
                raise_after_skips=config["optimizer.raise_after_skips"],
                check_finite_gradients=config["optimizer.check_finite_gradients"],
            ),
            cluster=ClusterSettings(
                colocate_split_and_replicate=config["cluster.colocate_split_and_replicate"],
                device_place_prefer_intra_node=config["cluster.device_place_prefer_intra_node"],
                run_visible_devices=config["cluster.run_visible_devices"],
            ),
            compile=CompileSettings(
                enabled=config["compile.enabled"],
                backend=config["compile.backend"],
                mode=config["compile.mode"],
            ),
            context=ContextSettings(
                degree=config["context.degree"],
                mode=config["context.mode"],
                presliced=config["context.presliced"],
                verify=config["context.verify"],
            ),
            fit_check=FitCheckSettings(
                action=config["fit_check.action"],
                device=config["fit_check.device"],
                enabled=config["fit_check.enabled"],
                micro_batch_size=config["fit_check.micro_batch_size"],
                sequence_length=config["fit_check.sequence_length"],
            ),
            float8=Float8Settings(
                enabled=config["float8.enabled"],
                recipe=config["float8.recipe"],
                exclude=tuple(config["float8.exclude"]),
                all_gather=config["float8.all_gather"],
            ),
            io=IoSettings(
                check_batches=config["io.check_batches"],
                check_batches_every=config["io.check_batches_every"],
                drop_last_files=config["io.drop_last_files"],
                slicing=config["io.slicing"],
                unbalanced_io_slicing=config["io.unbalanced_io_slicing"],
            ),
            model=ModelSettings(meta_init=config["model.meta_init"]),
            planner=PlannerSettings(
                device=config["planner.device"],
                global_batch_size=config["planner.global_batch_size"],
                sequence_length=config["planner.sequence_length"],
            ),
            split=SplitSettings(sequence_parallel=config["split.sequence_parallel"]),
        )
