"""The Plan: placement of TaskGraphs on devices, plan-only runs, and schedule types."""

from epl.plan.mode import PlanReady, PlanRequest, planning
from epl.plan.plan import DeviceAssignment, Plan, TaskGraphSpec, build_plan

__all__ = ["DeviceAssignment", "Plan", "PlanReady", "PlanRequest", "TaskGraphSpec", "build_plan", "planning"]
