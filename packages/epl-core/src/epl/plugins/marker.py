"""The marker plugins use on their hook implementations: ``@epl.hookimpl``."""

import pluggy

hookimpl = pluggy.HookimplMarker("epl")
