"""Config keys, the manual's key catalogue, and ``epl.Config``."""

from epl.config.catalogue import MANUAL_KEYS
from epl.config.config import Config
from epl.config.key import ConfigKey

__all__ = ["MANUAL_KEYS", "Config", "ConfigKey"]
