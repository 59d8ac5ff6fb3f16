"""An example EPL plugin, the one docs/plugins.md walks through.

It shows each kind of extension a plugin usually makes, each in its own module:

* :mod:`~epl_example_plugin.keys`: the config key it declares (``example.check_finite``);
* :mod:`~epl_example_plugin.settings`: its typed view of that key, which the hooks read;
* :mod:`~epl_example_plugin.schedules`: a pipeline schedule (``InOrderBackward``);
* :mod:`~epl_example_plugin.transforms`: a model transform with a phase, a no-op unless its key is set;
* :mod:`~epl_example_plugin.command`: an ``epl`` subcommand (``epl example-info``);
* :mod:`~epl_example_plugin.plugin`: the hooks that hand those to EPL (the entry point).

Like every plugin it imports nothing of epl-core but :mod:`epl.plugin_api`.
"""

from __future__ import annotations

#: The distribution's name: the entry point's name, so the name EPL registers the plugin under.
DISTRIBUTION = "epl-example-plugin"

__all__ = ["DISTRIBUTION"]
