"""Select stage: a balanced, diverse subset of the candidates (docs/design.md, "Select").

* :mod:`.quotas`: water-filled quotas per cluster, the published equal cut, token budgets, the selection weights
  and :func:`select`, the whole choice (pure);
* :mod:`.within`: inside one cluster, k-center greedy, distance strata and the published distance orders (pure);
* :mod:`.stage`: :func:`run` and :func:`select_with_config`, the job config's ``selection`` section applied.
"""

from .quotas import SelectionResult, equalize_count, select, selection_weights, water_fill_quotas
from .stage import SelectOutput, run, select_with_config
from .within import select_within

__all__ = [
    "SelectOutput",
    "SelectionResult",
    "equalize_count",
    "run",
    "select",
    "select_with_config",
    "select_within",
    "selection_weights",
    "water_fill_quotas",
]
