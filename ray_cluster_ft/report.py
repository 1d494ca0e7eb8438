"""``report.md`` and its PNG figures for one run directory (matplotlib, headless)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

__all__ = ["write_report"]


def _table(header: list[str], rows: list[list]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(out)


def _padded_load(plan: pd.DataFrame) -> pd.DataFrame:
    """Padded tokens per (step, rank): rows x longest sequence, summed over the step's micro-batches."""
    mb = plan.groupby(["step", "rank", "micro_index"])["n_tokens"].agg(["max", "size"])
    mb["padded"] = mb["max"] * mb["size"]
    return mb["padded"].groupby(["step", "rank"]).sum().unstack("rank")


def write_report(run_dir: Path, manifest: dict, plan: pd.DataFrame, labels: np.ndarray | None,
                 selected_idx: np.ndarray) -> Path:
    """Write ``report.md`` plus ``clusters.png``, ``load.png`` and ``loss.png`` into ``run_dir``.

    Args:
        run_dir: the run directory (holds ``train_log.jsonl`` when training ran).
        manifest: the run manifest (counts, timings, plan metrics, evaluation).
        plan: the allocation plan (``rank, step, micro_index, n_tokens`` ...).
        labels: cluster of every candidate example (int, (N,)), or None when no clustering ran.
        selected_idx: indices into ``labels`` of the selected examples.

    Returns:
        The path of ``report.md``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    lines = ["# ray-cluster-ft run report", "", f"Run directory: `{run_dir}`", ""]
    c = manifest["counts"]
    lines += ["## Counts", "", _table(["read", "accepted", "rejected", "held out", "selected", "not selected", "trained"],
                                      [[c["read"], c["accepted"], c["rejected"], c["held_out"], c["selected"],
                                        c["not_selected"], c["trained"]]]), ""]
    if c.get("rejected_by_reason"):
        lines += ["Rejected by reason (see `rejected.jsonl`):", "",
                  _table(["reason", "rows"], [[k, v] for k, v in c["rejected_by_reason"].items()]), ""]
    b = manifest.get("budget", {})
    if b.get("rounded_down_by"):
        lines += [f"The selection ({b['requested']}) was rounded down by {b['rounded_down_by']} so that every rank "
                  f"gets the same number of full micro-batches.", ""]
    lines += ["## Stage timings (s)", "", _table(list(manifest["timings_s"]), [list(manifest["timings_s"].values())]), ""]

    ev = manifest.get("eval", {})
    if ev.get("before"):
        rows = []
        for d, v in ev["before"].items():
            after = ev.get("after", {}).get(d, {})
            rows.append([d, v["examples"], v["loss"], after.get("loss", float("nan")), v["perplexity"],
                         after.get("perplexity", float("nan"))])
        lines += ["## Held-out loss (response tokens, nats/token)", "",
                  _table(["domain", "examples", "loss before", "loss after", "ppl before", "ppl after"], rows), ""]

    pm = manifest.get("plan_metrics", {})
    if pm:
        keys = list(next(iter(pm.values())).keys())
        lines += ["## Allocation plan vs random allocation", "",
                  _table(["metric"] + list(pm), [[k] + [pm[s].get(k) for s in pm] for k in keys]), ""]

    if labels is not None and len(labels):
        k = int(labels.max()) + 1
        sizes = np.bincount(labels, minlength=k)
        picked = np.bincount(labels[selected_idx], minlength=k)
        fig, ax = plt.subplots(figsize=(8, 3))
        x = np.arange(k)
        ax.bar(x, sizes, label="cluster size", color="#bbb")
        ax.bar(x, picked, label="selected", color="#1f77b4")
        ax.set_xlabel("cluster")
        ax.set_ylabel("examples")
        ax.legend()
        fig.tight_layout()
        fig.savefig(run_dir / "clusters.png", dpi=100)
        plt.close(fig)
        lines += ["## Clusters and per-cluster selection", "", "![clusters](clusters.png)", ""]

    load = _padded_load(plan)
    fig, ax = plt.subplots(figsize=(8, 3))
    for r in load.columns:
        ax.plot(load.index, load[r], marker=".", lw=1, label=f"rank {r}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("padded tokens")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(run_dir / "load.png", dpi=100)
    plt.close(fig)
    lines += ["## Per-rank token load per step (padded tokens)", "", "![load](load.png)", ""]

    log = run_dir / "train_log.jsonl"
    if log.exists():
        rows = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
        if rows:
            fig, ax = plt.subplots(figsize=(8, 3))
            ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], marker=".")
            ax.set_xlabel("optimizer step")
            ax.set_ylabel("training loss")
            fig.tight_layout()
            fig.savefig(run_dir / "loss.png", dpi=100)
            plt.close(fig)
            lines += ["## Training loss", "", "![loss](loss.png)", ""]

    path = run_dir / "report.md"
    path.write_text("\n".join(lines))
    return path
