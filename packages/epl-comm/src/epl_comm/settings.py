"""epl-comm's own view of its config keys: frozen and typed, built once per :class:`~epl.plugin_api.Config`.

This module is the one place of epl-comm that reads its keys by name (``tests/core/test_config_facts.py`` keeps it
so); the rest of the package reads :class:`CommSettings`' fields. What other packages need of these keys goes to
them as :class:`~epl.plugin_api.Communication` (``epl_config_facts``), built from this view.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from epl.plugin_api import ConfigView

if TYPE_CHECKING:
    from epl.plugin_api import Config


@dataclass(frozen=True)
class CommunicationSettings:
    """The ``communication.*`` keys (their docs: ``epl_comm/config_keys.py``, ``epl config``)."""

    num_communicators: int = 2
    sparse_as_dense: bool = False
    max_splits: int = 5
    bucket_size_mb: float = 25.0
    fp16: bool = False
    fp16_scale: int = 128
    clip_after_allreduce: bool = False
    gradients_reduce_method: Literal["mean", "sum"] = "mean"
    backend: Literal["auto", "torch", "cupy"] = "auto"
    check_steps: bool = True
    timeout: float = 600.0


@dataclass(frozen=True)
class CommSettings(ConfigView):
    """Every key epl-comm declares, by section: ``CommSettings.from_config(config).communication.timeout``."""

    communication: CommunicationSettings = field(default_factory=CommunicationSettings)

    @classmethod
    def read(cls, config: Config) -> CommSettings:
        """A new view of ``config``\'s values."""
        return cls(
            communication=CommunicationSettings(
                num_communicators=config["communication.num_communicators"],
                sparse_as_dense=config["communication.sparse_as_dense"],
                max_splits=config["communication.max_splits"],
                bucket_size_mb=float(config["communication.bucket_size_mb"]),
                fp16=config["communication.fp16"],
                fp16_scale=config["communication.fp16_scale"],
                clip_after_allreduce=config["communication.clip_after_allreduce"],
                gradients_reduce_method=config["communication.gradients_reduce_method"],
                backend=config["communication.backend"],
                check_steps=config["communication.check_steps"],
                timeout=float(config["communication.timeout"]),
            )
        )
