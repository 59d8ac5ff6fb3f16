"""This plugin's view of its config keys: frozen and typed, built once per :class:`~epl.plugin_api.Config`.

The one module of the plugin that reads its keys by name; the hooks read the view's fields
(``ExamplePluginSettings.from_config(context.config).example.check_finite``). ``epl example-info``
lists every key it declares by name, with its value and its source, as ``epl config`` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from epl.plugin_api import ConfigView

if TYPE_CHECKING:
    from epl.plugin_api import Config


@dataclass(frozen=True)
class ExampleSettings:
    """The ``example.*`` keys (``keys.py``), each field named after its key."""

    check_finite: bool = False


@dataclass(frozen=True)
class ExamplePluginSettings(ConfigView):
    """Every key this plugin declares, by section: ``ExamplePluginSettings.from_config(config).example``."""

    example: ExampleSettings = field(default_factory=ExampleSettings)

    @classmethod
    def read(cls, config: Config) -> ExamplePluginSettings:
        """A new view of ``config``'s values (``from_config``, inherited, builds it once per ``config``)."""
        return cls(example=ExampleSettings(check_finite=config["example.check_finite"]))
