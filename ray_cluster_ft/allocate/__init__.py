"""Allocation stage: the rank x step plan (:mod:`.plan`), its balance figures and hard rules (:mod:`.metrics`).

Pure functions, no Ray, no I/O; :func:`run` is the stage's edge that writes ``plan.parquet`` and
``selection.parquet``.
"""

from .metrics import check_plan, microbatch_table, plan_hash, plan_metrics
from .plan import PLAN_COLUMNS, PlanResult, make_plan
from .stage import AllocateOutput, plan_selection, run

__all__ = [
    "PLAN_COLUMNS",
    "AllocateOutput",
    "PlanResult",
    "check_plan",
    "make_plan",
    "microbatch_table",
    "plan_hash",
    "plan_metrics",
    "plan_selection",
    "run",
]
