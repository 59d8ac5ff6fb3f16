"""``epl.Config``: validated values for the keys the installed plugins declare; the core's own keys."""

from epl.config.catalogue import CORE_KEYS, KEY_OWNERS
from epl.config.config import Config, KeySource, use_default_key_source
from epl.interfaces.config_key import ConfigKey

__all__ = ["CORE_KEYS", "KEY_OWNERS", "Config", "ConfigKey", "KeySource", "use_default_key_source"]
