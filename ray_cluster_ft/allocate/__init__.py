"""Allocation stage: the rank x step plan (:mod:`.plan`), its balance figures and hard rules (:mod:`.metrics`).

Pure functions, no Ray, no I/O; :func:`run` is the stage's edge that writes ``plan.parquet`` and
``selection.parquet``.
"""

from .metrics import check_plan, plan_hash, plan_metrics
from .plan import PLAN_COLUMNS, PlanResult, make_plan
from .stage import AllocateOutput, plan_selection, run

__all__ = [
    "AllocateOutput",
    "PLAN_COLUMNS",
    "PlanResult",
    "check_plan",
    "make_plan",
    "plan_hash",
    "plan_metrics",
    "plan_selection",
    "run",
]
