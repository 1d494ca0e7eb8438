"""``report.md`` and its PNG figures for one run directory (matplotlib, headless)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

__all__ = ["FIGURES", "write_report"]

FIGURES = ("clusters.png", "load.png", "allocation.png", "loss.png")
"""The PNG files :func:`write_report` may write beside ``report.md``."""


def _table(header: list[str], rows: list[list]) -> str:
    def fmt(v):
        if isinstance(v, float):
            if v.is_integer() and abs(v) >= 1000:  # token counts: 13,848, not 1.385e+04
                return f"{v:,.0f}"
            return f"{v:.4g}"
        # Cells can hold values from the data (domains, reasons): a pipe or a line break would split the table.
        return " ".join(str(v).split()).replace("|", "\\|")

    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(out)


def _padded_load(plan: pd.DataFrame, packed: bool = False) -> pd.DataFrame:
    """Padded tokens per (step, rank): rows x longest sequence, summed over the step's micro-batches (a packed
    plan: real tokens, a pack has no padding)."""
    mb = plan.groupby(["step", "rank", "micro_index"])["n_tokens"].agg(["max", "size", "sum"])
    mb["padded"] = mb["sum"] if packed else mb["max"] * mb["size"]
    return mb["padded"].groupby(["step", "rank"]).sum().unstack("rank")


def _step_figures(plan: pd.DataFrame, packed: bool = False) -> dict:
    """Per-step series of one plan (index: optimizer step).

    Returns a dict with ``imbalance`` (max / mean over ranks of the rank's padded tokens in the step; real
    tokens when ``packed``), ``collisions`` (sum over micro_index of ranks - distinct majority clusters among
    the ranks' micro-batches; the majority rule of :func:`ray_cluster_ft.allocate.plan_metrics`),
    ``collisions_rows`` (every row counted: sum over clusters of the ranks holding it in the step - 1, as
    ``plan_metrics``' ``collisions_per_step_rows``), and the scalars ``padding`` (pad / padded tokens) and
    ``critical_path`` (sum over steps of the slowest rank's padded tokens).
    """
    from ..allocate.metrics import microbatch_table, row_collisions

    w = int(plan["rank"].nunique())
    mb = microbatch_table(plan)
    if packed:
        mb["padded"] = mb["real"]
    load = mb.groupby(["step", "rank"], sort=True)["padded"].sum().groupby(level="step")
    step_max = load.max()
    imbalance = step_max / (load.sum() / w)
    distinct = mb.groupby(["step", "micro_index"], sort=True)["major"].nunique()
    collisions = (w - distinct).groupby(level="step").sum()
    return {
        "imbalance": imbalance,
        "collisions": collisions,
        "collisions_rows": row_collisions(plan).reindex(step_max.index, fill_value=0),
        "padding": float(1.0 - mb["real"].sum() / mb["padded"].sum()),
        "critical_path": float(step_max.sum()),
    }


def _allocation_figure(path: Path, plan: pd.DataFrame, baseline_plan: pd.DataFrame, packed: bool = False) -> dict:
    """``allocation.png``: the plan beside the random baseline. Panels: per-step token max/mean across ranks,
    same-cluster collisions per step (solid: every row counted; dotted: by majority), padding fraction,
    critical-path tokens. Returns both plans' figures."""
    import matplotlib.pyplot as plt

    figs = {"plan": _step_figures(plan, packed), "random baseline": _step_figures(baseline_plan, packed)}
    colours = {"plan": "#1f77b4", "random baseline": "#d62728"}
    fig, axes = plt.subplots(2, 2, figsize=(11, 6))
    ax = axes[0, 0]
    for name, f in figs.items():
        ax.plot(f["imbalance"].index, f["imbalance"].to_numpy(), marker=".", lw=1, color=colours[name], label=name)
    ax.axhline(1.0, color="#888", lw=0.8, ls=":")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("token max / mean across ranks")
    ax.legend(fontsize=8)
    ax = axes[0, 1]
    for name, f in figs.items():
        ax.plot(f["collisions_rows"].index, f["collisions_rows"].to_numpy(), marker=".", lw=1,
                color=colours[name], label=f"{name} (per row)")
        ax.plot(f["collisions"].index, f["collisions"].to_numpy(), lw=1, ls=":", color=colours[name],
                label=f"{name} (majority)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("same-cluster collisions")
    ax.legend(fontsize=8)
    names = list(figs)
    for ax, key, label in ((axes[1, 0], "padding", "padding fraction of tokens"),
                           (axes[1, 1], "critical_path", "critical-path tokens")):
        vals = [figs[nm][key] for nm in names]
        bars = ax.bar(names, vals, color=[colours[nm] for nm in names])
        ax.bar_label(bars, labels=[f"{v:.3g}" for v in vals], fontsize=8)
        ax.set_ylabel(label)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return figs


def _cluster_map_lines(clustering: dict) -> list[str]:
    """The report's section on a reused cluster map (``clustering.from_run``): where it came from, the drift of
    the new rows and, above ``clustering.max_drift``, the suggestion to cluster again. Empty otherwise."""
    fr = clustering.get("from_run")
    if not fr:
        return []
    d = fr["drift"]
    share = "n/a (no new rows)" if d["share_new_beyond_p95"] is None else f"{d['share_new_beyond_p95']:.1%}"
    how = "k-means warm-started from its centroids" if fr["refit"] else "every row assigned to its nearest centroid"
    head = f"Cluster map of `{fr['run_dir']}` ({fr['map_k']} clusters): {how}."
    out = ["## Reused cluster map", "", head, "",
           _table(["rows", "new rows", "new rows beyond the map's p95 distance", "share", "max_drift",
                   "all rows beyond p95"],
                  [[d["rows"], d["new_rows"], d["new_beyond_p95"], share, d["max_drift"],
                    f"{d['share_all_beyond_p95']:.1%}"]]), ""]
    if d["suggest_recluster"]:
        out += [f"**Re-clustering suggested:** {clustering.get('drift_warning', 'drift above clustering.max_drift')}.",
                ""]
    return out


def _eval_lines(manifest: dict) -> list[str]:
    """The report's held-out sections: loss and task scores before and after training, and the extra
    ``evaluation.paths`` files. A score that was not measured is a blank cell."""
    lines: list[str] = []
    ev = manifest.get("eval", {})
    if ev.get("before"):
        rows = []
        for d, v in ev["before"].items():
            after = ev.get("after", {}).get(d, {})
            rows.append([d, v["examples"], v["loss"], after.get("loss", ""), v["perplexity"],
                         after.get("perplexity", "")])
        lines += ["## Held-out loss (response tokens, nats/token)", "",
                  _table(["domain", "examples", "loss before", "loss after", "ppl before", "ppl after"], rows), ""]
        if manifest.get("train") and not manifest.get("config", {}).get("output", {}).get("save_model", True):
            lines += ["No evaluation after training: `output.save_model` is false, so no final model was written.",
                      ""]
        task_rows = []
        for d, v in ev["before"].items():
            after = ev.get("after", {}).get(d, {})
            for key, count, label in (("mc_accuracy", "mc_items", "multiple-choice accuracy"),
                                      ("pass_at_1", "code_problems", "pass@1")):
                if key in v:
                    task_rows.append([d, label, v.get(count, ""), v[key], after.get(key, "")])
        if task_rows:
            lines += ["## Held-out task scores", "",
                      _table(["domain", "metric", "items", "before", "after"], task_rows), "",
                      "Per item (predictions, completions, test output): `eval_before_samples.jsonl`, "
                      "`eval_after_samples.jsonl`.", ""]

    files = manifest.get("eval_files") or {}
    if files:
        rows = []
        for path, f in files.items():
            b, a = f["before"].get("all", {}), f["after"].get("all", {})
            rows.append([Path(path).name, f["scored"], f["rejected"], f["overlap_with_candidates"],
                         b.get("loss", ""), a.get("loss", ""), b.get("mc_accuracy", ""), a.get("mc_accuracy", ""),
                         b.get("pass_at_1", ""), a.get("pass_at_1", "")])
        lines += ["## Extra held-out files (`evaluation.paths`)", "",
                  _table(["file", "scored", "rejected", "also candidates", "loss before", "loss after",
                          "MC before", "MC after", "pass@1 before", "pass@1 after"], rows), ""]
        if not any(f["before"] or f["after"] for f in files.values()):
            lines += ["Not scored: this run evaluated nothing (`--plan-only`).", ""]
        unused = [f"`{src}`: " + ", ".join(f"{k} ({n})" for k, n in per["unused_fields"].items())
                  for f in files.values() for src, per in (f.get("data_files") or {}).items() if per["unused_fields"]]
        if unused:
            lines += ["Text fields of these files that their row format does not use, so not scored "
                      "(`data.unused_fields`; rows): " + "; ".join(unused) + ".", ""]
    return lines


# One section of report.md after another; each figure is its own helper above.
def write_report(run_dir: Path, manifest: dict, plan: pd.DataFrame, labels: np.ndarray | None,
                 selected_idx: np.ndarray, baseline_plan: pd.DataFrame | None = None,
                 trained_examples: list[str] | None = None) -> Path:
    """Write ``report.md`` plus ``clusters.png``, ``load.png``, ``allocation.png`` and ``loss.png`` into ``run_dir``.

    Args:
        run_dir: the run directory (holds ``train_log.jsonl`` when training ran).
        manifest: the run manifest (counts, timings, plan metrics, evaluation).
        plan: the allocation plan (``rank, step, micro_index, cluster, n_tokens`` ...).
        labels: cluster of every candidate example (int, (N,)), or None when no clustering ran.
        selected_idx: indices into ``labels`` of the selected examples.
        baseline_plan: the random allocation of the same selection (``make_plan(..., strategy="random")``),
            or None. When given, ``allocation.png`` draws the plan and the baseline side by side: per-step
            token max/mean across ranks, same-cluster collisions per step, padding fraction and
            critical-path tokens (issue 4); the plan needs a ``cluster`` column for the collisions.
        trained_examples: decoded examples with the trained part marked
            (:func:`ray_cluster_ft.data.marked_text`), shown under "What is trained" with the manifest's
            ``data_files`` (formats and unused fields per file).

    Returns:
        The path of ``report.md``.
    """
    import matplotlib

    matplotlib.use("Agg")

    run_dir = Path(run_dir)
    lines = ["# ray-cluster-ft run report", "", f"Run directory: `{run_dir}`", ""]
    lines += _count_lines(manifest)
    lines += _trained_lines(manifest, trained_examples or [])
    timings = manifest["timings_s"]
    lines += ["## Stage timings (s)", "", _table(list(timings), [list(timings.values())]), ""]

    lines += _eval_lines(manifest)

    pm = manifest.get("plan_metrics", {})
    if pm:
        keys = list(next(iter(pm.values())).keys())
        lines += ["## Allocation plan vs random allocation", "",
                  _table(["metric"] + list(pm), [[k] + [pm[s].get(k) for s in pm] for k in keys]), ""]
        lines += _packing_lines(manifest.get("allocation"), manifest.get("config", {}).get("train", {}),
                                (pm.get("cluster") or {}).get("collisions_per_step_rows"))

    warning = manifest.get("clustering", {}).get("warning")
    if warning:
        lines += [f"**Warning:** {warning}.", ""]
    lines += _cluster_map_lines(manifest.get("clustering", {}))
    if labels is not None and len(labels):
        lines += _clusters_figure(run_dir / "clusters.png", labels, selected_idx)
    lines += _cluster_contents_lines(manifest.get("clustering", {}))

    packed = any("pack_fill" in m for m in pm.values()) if pm else False
    lines += _load_figure(run_dir / "load.png", plan, packed)
    if baseline_plan is not None and len(baseline_plan) and "cluster" in plan.columns:
        lines += _plan_vs_baseline_lines(run_dir / "allocation.png", plan, baseline_plan, packed, pm)
    log = run_dir / "train_log.jsonl"
    if log.exists():
        lines += _loss_figure(run_dir / "loss.png", log)

    path = run_dir / "report.md"
    path.write_text("\n".join(lines))
    return path


def _packing_lines(alloc: dict | None, train: dict, collisions_rows: float | None = None) -> list[str]:
    """The report's lines on packing and per-row collisions: what ``allocation.packing`` resolved to, the pack
    size, and whether ``collisions_per_step_rows`` can be 0: it cannot while a cluster holds more than 1/W of the
    planned tokens (each such cluster named with its share); ``collisions_rows``, the plan's own figure, is
    named where a packed plan that could reach 0 did not (too few rows to fill every step)."""
    if not alloc:
        return []
    w = train.get("num_workers")
    setting = alloc["packing_setting"]
    how = f"`allocation.packing: {str(setting).lower()}`"
    if alloc["packing"]:
        size = ("chosen from the data" if alloc.get("pack_size") == "data" else "as set")
        text = (f"Packed ({how}): packs of at most {alloc['max_tokens_per_micro_batch']:,} tokens ({size}), "
                f"position_ids restarting per example, no padding.")
    else:
        text = f"Not packed ({how}): micro-batches of `train.micro_batch_size` padded rows."
    big = alloc.get("over_share") or []
    if big:
        names = ", ".join(f"cluster {b['cluster']} ({b['token_share']:.1%} of the tokens)" for b in big)
        text += (f" Same-cluster collisions counted per row cannot be 0: {names} holds more than 1/{w} of the "
                 f"planned tokens, so it sits on two ranks at some step under any plan (a soft cap counting tokens, "
                 f"`clustering.max_cluster_ratio` with `cap_by: tokens`, or a larger `clustering.k` avoids it).")
    else:
        text += f" No cluster holds more than 1/{w} of the planned tokens, so every step's ranks can hold distinct "
        if not alloc["packing"]:
            tail = "; the unpacked plan keeps only each micro-batch's majority apart."
        elif collisions_rows:
            tail = (f"; this packed plan still has {collisions_rows:g} same-cluster collisions per step counted per "
                    f"row: its clusters hold too few rows to fill every step with distinct ones.")
        else:
            tail = " (the packed cluster plan keeps them so)."
        text += "clusters counted per row" + tail
    return [text, ""]
def _trained_lines(manifest: dict, examples: list[str]) -> list[str]:
    """"What is trained": the formats and unused text fields per file, then the decoded examples."""
    files = manifest.get("data_files") or {}
    if not files and not examples:
        return []
    lines = ["## What is trained", ""]
    if files:
        rows = [[f"`{src}`", f["rows"], ", ".join(f"{k} ({n})" for k, n in f["formats"].items()) or "-",
                 ", ".join(f"{k} ({n})" for k, n in f["unused_fields"].items()) or "-"] for src, f in files.items()]
        lines += [_table(["file", "rows read", "formats (rows)", "unused text fields (rows)"], rows), ""]
    if examples:
        lines += ["Candidate examples as the model sees them: the masked part (prompt, template, labels -100) as "
                  "plain text, the trained part between `[[` and `]]`:", ""]
        for ex in examples:
            lines += ["```", ex.replace("```", "` ` `"), "```", ""]
    return lines


def _count_lines(manifest: dict) -> list[str]:
    """The counts table, rejections by reason, features computed and reused, the budget's rounding."""
    c = manifest["counts"]
    header = ["read", "accepted", "rejected", "held out", "selected", "not selected", "trained"]
    lines = ["## Counts", "", _table(header, [[c["read"], c["accepted"], c["rejected"], c["held_out"], c["selected"],
                                               c["not_selected"], c["trained"]]]), ""]
    if c.get("rejected_by_reason"):
        lines += ["Rejected by reason (see `rejected.jsonl`):", "",
                  _table(["reason", "rows"], [[k, v] for k, v in c["rejected_by_reason"].items()]), ""]
    if c.get("features_computed", 0) + c.get("features_reused", 0):
        store = manifest.get("sketch", {}).get("store")
        where = f" (feature store `{store}`)." if store else "."
        lines += [f"Features: {c['features_computed']} computed, {c['features_reused']} reused{where}", ""]
    lines += _selection_lines(manifest)
    b = manifest.get("budget", {})
    if b.get("rounded_down_by"):
        lines += [f"The selection ({b['requested']}) was rounded down by {b['rounded_down_by']} so that every rank "
                  f"gets the same number of full micro-batches.", ""]
    return lines


def _selection_lines(manifest: dict) -> list[str]:
    """One sentence naming the settings that decided which rows were chosen (a reader of the report alone
    should not need config.yaml to know whether a selection was balanced, on which feature)."""
    cfg = manifest.get("config", {})
    sel, feat = cfg.get("selection", {}), cfg.get("sketch", {})
    if not sel:
        return []
    strategy = sel.get("strategy")
    what = f"Selection: `{strategy}`"
    if strategy in ("balanced", "equalize"):
        what += f" on `sketch.method: {feat.get('method')}` features, within clusters `{sel.get('within')}`"
    if strategy == "balanced":
        groups = manifest.get("budget", {}).get("groups")
        made = f" ({len(set(groups))} made)" if groups else ""
        what += (f", groups `{sel.get('groups')}`{made}" if sel.get("groups") is not None
                 else ", groups `null` (every cluster one share)")
        what += f", size_power {sel.get('size_power')}"
    if strategy in ("balanced", "random"):
        tokens, budget = sel.get("budget_tokens"), sel.get("budget")
        if tokens is not None:
            what += f", budget {int(tokens):,} tokens" if tokens > 1 else \
                f", budget {tokens:g} of the candidates' tokens"
        else:
            what += f", budget {int(budget):,} rows" if budget > 1 else f", budget {budget:g} of the candidates"
    elif strategy == "equalize":
        what += f", ratio {sel.get('ratio')}"
    return [what + ".", ""]


def _clusters_figure(path: Path, labels: np.ndarray, selected_idx: np.ndarray) -> list[str]:
    """``clusters.png``: each cluster's size and its selected rows; returns the report's lines for it."""
    import matplotlib.pyplot as plt

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
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return ["## Clusters and per-cluster selection", "", "![clusters](clusters.png)", ""]


def _cluster_contents_lines(clustering: dict) -> list[str]:
    """"What each cluster holds": per cluster its size, its largest sources, token lengths, selected rows and
    weight, then three example prompts; the NMI between clusters and source (the manifest's
    ``clustering.clusters`` and ``clustering.nmi``)."""
    clusters = clustering.get("clusters")
    if not clusters:
        return []
    field = clustering.get("source_field")
    if field is None:
        head = "No source is known (every row has the same `source` and `domain`), so no NMI."
    else:
        head = (f"Source: the rows' `{field}`. Normalised mutual information between clusters and {field}: "
                f"{clustering['nmi']:.3f} (1 = every cluster holds one {field} and every {field} one cluster).")

    def top(shares: dict) -> str:
        parts = [f"{s} {v:.0%}" for s, v in list(shares.items())[:3]]
        return ", ".join(parts) + (f", +{len(shares) - 3} more" if len(shares) > 3 else "") if parts else "-"

    rows = [[c["cluster"], c["size"], top(c["sources"]), f"{c['tokens_min']}–{c['tokens_max']}",
             round(c["tokens_mean"], 1), c["selected"], round(c["weight"], 3)] for c in clusters]
    lines = ["## What each cluster holds", "", head, "",
             _table(["cluster", "rows", f"{field or 'source'} (share of its rows)", "tokens", "mean tokens",
                     "selected", "weight (sum)"], rows), "", "Example prompts (a seeded choice, cut at 120 characters):",
             ""]
    for c in clusters:
        lines += [f"- cluster {c['cluster']}: " + " · ".join(f"“{t}”" for t in c["examples"])]
    return lines + [""]


def _load_figure(path: Path, plan: pd.DataFrame, packed: bool) -> list[str]:
    """``load.png``: every rank's (padded) tokens per step; returns the report's lines for it."""
    import matplotlib.pyplot as plt

    load = _padded_load(plan, packed)
    fig, ax = plt.subplots(figsize=(8, 3))
    for r in load.columns:
        ax.plot(load.index, load[r], marker=".", lw=1, label=f"rank {r}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("tokens (packed)" if packed else "padded tokens")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [f"## Per-rank token load per step ({'tokens, packed' if packed else 'padded tokens'})", "",
            "![load](load.png)", ""]


def _plan_vs_baseline_lines(path: Path, plan: pd.DataFrame, baseline_plan: pd.DataFrame, packed: bool,
                            pm: dict) -> list[str]:
    """``allocation.png`` (:func:`_allocation_figure`) and the report's lines on collisions and the critical
    path of the plan against the random baseline."""
    figs = _allocation_figure(path, plan, baseline_plan, packed)
    ratio = figs["plan"]["critical_path"] / figs["random baseline"]["critical_path"]
    own = next((m for name, m in pm.items() if not name.startswith("random")), {}) if pm else {}
    bound, bound_ratio = own.get("critical_path_bound_tokens"), own.get("critical_path_vs_bound")
    return ["## Allocation per step: plan vs random baseline", "",
            (f"Same-cluster collisions per step, every row counted: "
             f"{float(figs['plan']['collisions_rows'].mean()):.3f} (plan) vs "
             f"{float(figs['random baseline']['collisions_rows'].mean()):.3f} (random); by each "
             f"micro-batch's majority: {float(figs['plan']['collisions'].mean()):.3f} vs "
             f"{float(figs['random baseline']['collisions'].mean()):.3f}."), "",
            f"Critical path of the plan: {ratio:.3f}x the random baseline's"
            + (f"; {bound_ratio:.3f}x the lower bound for any plan of these examples "
               f"({bound:,.0f} tokens)." if bound else "."), "",
            "![allocation](allocation.png)", ""]


def _loss_figure(path: Path, log: Path) -> list[str]:
    """``loss.png`` from ``train_log.jsonl`` (nothing when the log has no step); returns the report's lines."""
    import matplotlib.pyplot as plt

    rows = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    if not rows:
        return []
    fig, ax = plt.subplots(figsize=(8, 3))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], marker=".")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return ["## Training loss", "", "![loss](loss.png)", ""]
