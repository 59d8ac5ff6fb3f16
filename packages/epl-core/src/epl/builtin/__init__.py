"""The core's built-in plugin and what it registers: the one-process communicator, the local step runner,
tensor parallelism's model transform and shard estimates, and (in ``epl.cli``) the ``epl`` subcommands.

The top layer of epl-core: it implements hooks like any plugin, and nothing below imports it
(the plugin manager loads :mod:`epl.builtin.plugin` by name).
"""
