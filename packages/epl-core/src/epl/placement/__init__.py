"""The Plan: placement of TaskGraphs on devices (plain data), memory estimates, plan-only requests."""

from epl.placement.build import build_local_plan, build_plan
from epl.placement.memory_estimate import MemoryEstimate
from epl.placement.plan import DeviceAssignment, Plan, TaskGraphSpec
from epl.placement.request import PlanReady, PlanRequest, planning

__all__ = [
    "DeviceAssignment",
    "MemoryEstimate",
    "Plan",
    "PlanReady",
    "PlanRequest",
    "TaskGraphSpec",
    "build_local_plan",
    "build_plan",
    "planning",
]
