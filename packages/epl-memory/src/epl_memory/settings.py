"""epl-memory's own view of its config keys: frozen and typed, built once per :class:`~epl.plugin_api.Config`.

This module is the one place of epl-memory that reads its keys by name (``tests/core/test_config_facts.py`` keeps it
so); the rest of the package reads :class:`MemorySettings`' fields. What other packages need of these keys goes to
them as :class:`~epl.plugin_api.MemoryTechniques` (``epl_config_facts``), built from this view.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from epl.plugin_api import ConfigView

if TYPE_CHECKING:
    from epl.plugin_api import Config

Dtype = Literal["", "bfloat16", "float16", "float32"]


@dataclass(frozen=True)
class CheckpointSettings:
    """The ``gradient_checkpoint.*`` keys."""

    type: Literal["", "collection", "auto", "selective"] = ""
    end_taskgraph: int = -1
    check_gradients: bool = False


@dataclass(frozen=True)
class ZeroSettings:
    """The ``zero.*`` keys."""

    level: Literal["", "v0", "v1", "v2"] = ""
    shard_degree: int = 0
    param_dtype: Dtype = ""
    reduce_dtype: Dtype = ""


@dataclass(frozen=True)
class OffloadSettings:
    """The ``offload.*`` keys."""

    level: Literal["", "v0"] = ""
    overlap_step: bool = False


@dataclass(frozen=True)
class AmpSettings:
    """The ``amp.*`` keys."""

    level: Literal["", "O1"] = ""
    debug_log: bool = False
    #: ``"dynamic"``, or a fixed scale.
    loss_scale: Literal["dynamic"] | int = "dynamic"
    dtype: Literal["", "float16", "bfloat16"] = ""
    growth_interval: int = 2000


@dataclass(frozen=True)
class MemorySettings(ConfigView):
    """Every key epl-memory declares, by section: ``MemorySettings.from_config(config).zero.level``."""

    gradient_checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    zero: ZeroSettings = field(default_factory=ZeroSettings)
    offload: OffloadSettings = field(default_factory=OffloadSettings)
    amp: AmpSettings = field(default_factory=AmpSettings)
    #: ``optimizer.num_apply_group``.
    num_apply_group: int = 1

    @classmethod
    def read(cls, config: Config) -> MemorySettings:
        """A new view of ``config``\'s values."""
        return cls(
            gradient_checkpoint=CheckpointSettings(
                type=config["gradient_checkpoint.type"],
                end_taskgraph=config["gradient_checkpoint.end_taskgraph"],
                check_gradients=config["gradient_checkpoint.check_gradients"],
            ),
            zero=ZeroSettings(
                level=config["zero.level"],
                shard_degree=config["zero.shard_degree"],
                param_dtype=config["zero.param_dtype"],
                reduce_dtype=config["zero.reduce_dtype"],
            ),
            offload=OffloadSettings(level=config["offload.level"], overlap_step=config["offload.overlap_step"]),
            amp=AmpSettings(
                level=config["amp.level"],
                debug_log=config["amp.debug_log"],
                loss_scale=config["amp.loss_scale"],
                dtype=config["amp.dtype"],
                growth_interval=config["amp.growth_interval"],
            ),
            num_apply_group=config["optimizer.num_apply_group"],
        )
