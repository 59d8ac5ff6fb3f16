"""The config keys this plugin declares (``epl_config_keys``); EPL records the plugin as their ``provided_by``."""

from __future__ import annotations

from epl.plugin_api import ConfigKey

#: The name of the one key, as declared here and named in the transform's error.
CHECK_FINITE = "example.check_finite"

KEYS: tuple[ConfigKey, ...] = (
    ConfigKey(
        name=CHECK_FINITE,
        types=(bool,),
        default=False,
        doc="Check in epl.parallelize that every parameter this rank keeps is finite (no NaN or inf) "
        "before training starts, and name the first one that is not.",
    ),
)
