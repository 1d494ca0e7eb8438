"""ray-cluster-ft: clustering-based balanced sampling and allocation (CluSTER, EMNLP 2026) for data-parallel
fine-tuning, as a distributed workflow on Ray (Ray Data sketches, driver-side selection and planning, Ray Train +
DeepSpeed training).

Stages, one module each: ``config``, ``data``, ``sketch``, ``clustering``, ``select``, ``allocate``, ``train``,
``evaluate``, ``pipeline``, ``cli``.
"""

__version__ = "0.1.0"
