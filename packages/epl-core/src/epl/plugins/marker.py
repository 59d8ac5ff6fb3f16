"""The marker plugins use on their hook implementations: ``@epl.hookimpl``."""

import pluggy

hookimpl = pluggy.HookimplMarker("epl")
"""Mark a plugin's function as the implementation of the EPL hook of the same name: ``@epl.hookimpl``.

Options are pluggy's (``@epl.hookimpl(trylast=True)``, ``tryfirst``, ``wrapper``); the hooks are
those of :mod:`epl.plugins.hookspecs`.
"""
