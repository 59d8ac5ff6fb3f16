"""The contracts plugins build on, which depend on nothing else of EPL.

The lowest layer of epl-core but for ``epl.errors`` and ``epl.ports``: the
communicator protocol and helpers over it, the cluster a process belongs to,
pipeline schedule actions, the split-rule and shard-group types, the config-key
type, an optimizer group's options, and the phases model transforms and optimizer
wrappers run in. Plugins import these through :mod:`epl.plugin_api`.
"""
