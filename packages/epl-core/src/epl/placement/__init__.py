"""The Plan: placement of TaskGraphs on devices, and plan-only runs."""

from epl.placement.estimate import MemoryEstimate
from epl.placement.mode import PlanReady, PlanRequest, planning
from epl.placement.plan import DeviceAssignment, Plan, TaskGraphSpec, build_plan

__all__ = [
    "DeviceAssignment",
    "MemoryEstimate",
    "Plan",
    "PlanReady",
    "PlanRequest",
    "TaskGraphSpec",
    "build_plan",
    "planning",
]
