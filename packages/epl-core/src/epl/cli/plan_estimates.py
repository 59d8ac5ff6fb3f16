"""What ``epl plan --device ...`` prints: the planner's estimates of the script's layout, or ``--auto``'s search."""

from __future__ import annotations

import json

from epl.placement.request import PlanReady
from epl.planner.devices import device_profile
from epl.planner.estimate import estimate
from epl.planner.from_plan import layout_of, precision_of
from epl.planner.layout import Workload
from epl.planner.render import describe, describe_search, heading
from epl.planner.search import search
from epl.planner.shape import ModelShape


def show_estimates(
    ready: PlanReady, device: str, global_batch: int, sequence: int, dtype: str | None, auto: bool, as_json: bool
) -> str:
    """The text (or JSON) of the estimates for the planned run ``ready`` on ``device``; ``dtype`` None: bf16, as
    autocast over float32 weights when the script's config sets ``amp.level`` (:func:`precision_of`)."""
    profile = device_profile(device)
    plan = ready.plan
    shape = ModelShape.of(ready.model)
    autocast = dtype is None and precision_of(ready.config)[1]
    workload = Workload(
        global_batch, sequence, dtype=dtype or "bf16", autocast=autocast, devices_per_node=plan.gpu_per_worker
    )
    if auto:
        result = search(shape, workload, profile, plan.world_size)
        if as_json:
            return json.dumps(
                {"plans": [p.to_dict() for p in result.plans], "searched": result.searched,
                 "search_seconds": result.search_seconds}, indent=2,
            )  # fmt: skip
        return heading(profile, workload, plan.world_size) + "\n" + describe_search(result, profile)
    predicted = estimate(shape, layout_of(plan, ready.config, global_batch), workload, profile)
    if as_json:
        return json.dumps({**predicted.to_dict(), "placement": plan.to_dict()}, indent=2)
    return f"{plan}\n\n{heading(profile, workload, plan.world_size)}\n{describe(predicted, profile)}"
