"""The planner: activation memory, step time and MFU of a layout, and the search for the best one (``epl plan``).

Analytical and fast: a layout's estimate is a few formulas over the model's shape (:mod:`~epl.planner.shape`),
the layout (:mod:`~epl.planner.layout`), the job (global batch, sequence length, dtype) and a device profile
(:mod:`~epl.planner.devices`). The modules: :mod:`~epl.planner.activations` (what a block saves for backward,
and what a schedule keeps in flight) · :mod:`~epl.planner.estimate` (memory per device, step time and its parts,
tokens/s, MFU) · :mod:`~epl.planner.search` (``--auto``). See docs/planner.md.
"""

from epl.planner.devices import PROFILES, DeviceProfile, device_profile
from epl.planner.estimate import Estimate, estimate
from epl.planner.layout import Layout, Workload
from epl.planner.search import SearchResult, search
from epl.planner.shape import ModelShape

__all__ = [
    "PROFILES", "DeviceProfile", "Estimate", "Layout", "ModelShape", "SearchResult", "Workload",
    "device_profile", "estimate", "search",
]  # fmt: skip
