"""Feature stage: a per-example learning-effect feature for every candidate, computed by Ray Data actors.

* :mod:`.projection`: the LoGra factorised gradient sketch (Choe et al. 2024, Sec. 3), pure torch;
* :mod:`.last_layer`: the published method's last-layer gradient proxy (one inference forward);
* :mod:`.hidden_mean`: the RDS+ feature, pooled final hidden states (one forward without the LM head);
* :mod:`.windows`: the ``sketch.max_tokens`` window of a row;
* :mod:`.reference`: slow exact references (per-example autograd, explicit Kronecker projection) for tests;
* :mod:`.sketchers`: the gradient sketch, the last-layer and hidden-state features and the embedding baseline
  behind one interface (:func:`make_sketcher`);
* :mod:`.store`: resumable Parquet shards keyed by settings, model and inputs; :func:`read_sketches`;
* :mod:`.feature_store`: the cross-run feature store (``sketch.store``), content-addressed, on any pyarrow
  filesystem;
* :mod:`.stage`: the Ray Data actor pool (:func:`compute_sketches`) and the stage (:func:`run`).

The optional warm-up of the sketch model (LESS, Xia et al. 2024) trains, so it lives above training, in
:mod:`ray_cluster_ft.pipeline.warmup`.
"""

from .feature_store import FeatureStore
from .inputs import prepare_sketch_inputs
from .last_layer import last_layer_features
from .projection import make_projector, select_modules, sketch_batch
from .sketchers import make_sketcher
from .stage import FeaturesOutput, compute_sketches, run, sketch_with_store
from .store import FeatureShards, feature_shards, read_shard, read_sketches, stream_features, streaming_unsupported

__all__ = [
    "FeatureShards",
    "FeatureStore",
    "FeaturesOutput",
    "feature_shards",
    "read_shard",
    "stream_features",
    "streaming_unsupported",
    "compute_sketches",
    "last_layer_features",
    "make_projector",
    "make_sketcher",
    "prepare_sketch_inputs",
    "read_sketches",
    "run",
    "select_modules",
    "sketch_batch",
    "sketch_with_store",
]
