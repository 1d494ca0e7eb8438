"""Named published configurations a job spec can start from (``preset:``), merged under the spec's own keys."""

from __future__ import annotations

from pydantic import ValidationError

PRESETS: dict[str, dict] = {
    # The published method as its official code runs it with its defaults (kaist-dmlab/CluSTER,
    # src/CluSTER/call_back.py and train_grad.py: seed 42, ratio 100, prune "close", dataloader_drop_last off):
    # last-layer gradient proxy, KMeans(random_state=42) with k = the number of GPUs and a 1.5 N/K soft cap,
    # every cluster cut to the smallest one's size keeping the points farthest from their centroid (no rounding
    # to the micro-batch: a rank's last micro-batch may be short), rank r trains cluster r, and each rank's loss
    # weighted back to its cluster's share of the data. At world size 1: one cluster, every row, weight 1.
    "cluster-paper": {
        "sketch": {"method": "last_layer"},
        "clustering": {"k": "world_size", "algorithm": "kmeans", "max_cluster_ratio": 1.5, "cap_by": "rows",
                       "seed": 42},
        "selection": {"strategy": "equalize", "ratio": 1.0, "within": "peripheral"},
        "allocation": {"strategy": "cluster_per_rank"},
        "train": {"loss_weighting": "cluster"},
    },
}
"""Named sets of keys a spec's ``preset:`` fills in; keys written in the spec override them."""


def with_preset(raw: dict) -> dict:
    """``raw`` merged over its preset's keys (recursively, the spec's values win)."""
    name = raw.get("preset")
    if name is None or not isinstance(name, str) or name not in PRESETS:
        return raw  # the Literal field reports an unknown or mistyped name

    def merge(base: dict, over: dict) -> dict:
        out = dict(base)
        for k, v in over.items():
            out[k] = merge(out[k], v) if isinstance(out.get(k), dict) and isinstance(v, dict) else v
        return out

    return merge(PRESETS[name], raw)


def preset_note(raw: dict, err: ValidationError) -> str:
    """What the spec's preset set in the sections an error names: the user may not have written the value the
    error is about."""
    preset = PRESETS.get(raw.get("preset")) if isinstance(raw.get("preset"), str) else None
    if not preset:
        return ""
    sections = {e["loc"][0] for e in err.errors() if e["loc"]}
    filled = [f"{sec}.{k}={v}" for sec in preset if sec in sections for k, v in preset[sec].items()
              if k not in (raw.get(sec) or {})]
    return f" (preset {raw['preset']!r} sets {', '.join(filled)}; a key in the spec overrides it)" if filled else ""
