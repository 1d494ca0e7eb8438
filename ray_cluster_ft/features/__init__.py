"""Feature stage: a per-example learning-effect feature for every candidate, computed by Ray Data actors.

* :mod:`.projection`: the LoGra factorised gradient sketch (Choe et al. 2024, Sec. 3), pure torch;
* :mod:`.last_layer`: the published method's last-layer gradient proxy (one inference forward);
* :mod:`.reference`: slow exact references (per-example autograd, explicit Kronecker projection) for tests;
* :mod:`.sketchers`: the gradient sketch and the embedding baseline behind one interface
  (:func:`make_sketcher`);
* :mod:`.store`: resumable Parquet shards keyed by settings, model and inputs; :func:`read_sketches`;
* :mod:`.feature_store`: the cross-run feature store (``sketch.store``), content-addressed, on any pyarrow
  filesystem;
* :mod:`.stage`: the Ray Data actor pool (:func:`compute_sketches`) and the stage (:func:`run`).

The optional warm-up of the sketch model (LESS, Xia et al. 2024) trains, so it lives above training, in
:mod:`ray_cluster_ft.pipeline.warmup`.
"""

from .feature_store import FeatureStore, model_fingerprint, row_input_hashes, store_key
from .inputs import SketchInputs, prepare_sketch_inputs, same_tokenization
from .last_layer import last_layer_features, normalise_last_layer
from .projection import Projector, make_projector, select_modules, sketch_batch
from .reference import exact_sketch, sketch_fidelity, weight_gradients
from .sketchers import (
    EMBEDDING_PACKAGE,
    EmbeddingSketcher,
    GradientSketcher,
    LastLayerSketcher,
    embedding_model_dir,
    length_batches,
    make_sketcher,
)
from .stage import FeaturesOutput, ShardSketcher, compute_sketches, run, sketch_with_store
from .store import Shard, plan_shards, read_sketches, sketch_fingerprint

__all__ = [
    "EMBEDDING_PACKAGE",
    "EmbeddingSketcher",
    "FeaturesOutput",
    "FeatureStore",
    "GradientSketcher",
    "LastLayerSketcher",
    "Projector",
    "Shard",
    "ShardSketcher",
    "SketchInputs",
    "compute_sketches",
    "embedding_model_dir",
    "exact_sketch",
    "last_layer_features",
    "length_batches",
    "make_projector",
    "make_sketcher",
    "model_fingerprint",
    "normalise_last_layer",
    "plan_shards",
    "prepare_sketch_inputs",
    "read_sketches",
    "row_input_hashes",
    "run",
    "same_tokenization",
    "select_modules",
    "sketch_batch",
    "sketch_fidelity",
    "sketch_fingerprint",
    "sketch_with_store",
    "store_key",
    "weight_gradients",
]
