"""Cluster stage: the features grouped by direction (spherical k-means, docs/design.md "Cluster"), or by the
published method's Euclidean k-means with its soft cap; an earlier run's cluster map reused
(``clustering.from_run``).

* :mod:`.kmeans`: spherical k-means, the ``auto`` k rule, small clusters merged, warm-started refits;
  :func:`cluster_sketches` puts them together (pure);
* :mod:`.capped`: the published Euclidean k-means and its soft cap on cluster sizes (pure);
* :mod:`.cluster_map`: assignment to a saved map, drift, the features check (pure);
* :mod:`.stage`: :func:`run` (``clusters.parquet``, ``centroids.parquet``) and every other file read or written.
"""

from .capped import euclidean_kmeans, soft_cap_labels
from .cluster_map import ClusterMap
from .kmeans import ClusterResult, auto_k, cluster_sketches, spherical_kmeans
from .stage import ClusterOutput, cluster_with_config, load_cluster_map, run

__all__ = [
    "ClusterMap",
    "ClusterOutput",
    "ClusterResult",
    "auto_k",
    "cluster_sketches",
    "cluster_with_config",
    "euclidean_kmeans",
    "load_cluster_map",
    "run",
    "soft_cap_labels",
    "spherical_kmeans",
]
