"""epl-pipeline's own view of its config keys: frozen and typed, built once per :class:`~epl.plugin_api.Config`.

This module is the one place of epl-pipeline that reads its keys by name (``tests/core/test_config_facts.py`` keeps
it so); the rest of the package reads :class:`PipelineSettings`' fields. What other packages need of these keys goes
to them as :class:`~epl.plugin_api.PipelineChoices` (``epl_config_facts``), built from this view.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from epl.plugin_api import ConfigView

if TYPE_CHECKING:
    from epl.plugin_api import Config


@dataclass(frozen=True)
class PipelineSettings(ConfigView):
    """The keys epl-pipeline declares: ``pipeline.num_stages``, ``pipeline.strategy``, ``pipeline.split_points``
    and ``auto.auto_parallel``."""

    num_stages: int | None = None
    strategy: str = "PreferBackward"
    #: The qualified names of the modules the stages after the first begin at (None: not given).
    split_points: tuple[str, ...] | None = None
    #: True: cut into ``num_stages`` balanced stages; ``"plan"``: the planner chooses the layout.
    auto_parallel: bool | Literal["plan"] = False

    @classmethod
    def read(cls, config: Config) -> PipelineSettings:
        """A new view of ``config``\'s values."""
        points = config["pipeline.split_points"]
        return cls(
            num_stages=config["pipeline.num_stages"],
            strategy=config["pipeline.strategy"],
            split_points=None if points is None else tuple(points),
            auto_parallel=config["auto.auto_parallel"],
        )
