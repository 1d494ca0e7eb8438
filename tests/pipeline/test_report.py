"""report.md's "What is trained": the formats and unused fields per file and decoded examples, prompt masked,
response marked."""

from __future__ import annotations

import numpy as np

from ray_cluster_ft.data import marked_text
from ray_cluster_ft.data.formats import canonical_row
from ray_cluster_ft.data.tokenize import tokenize_rows


def test_what_is_trained_section(tmp_path, demo_tokenizer):
    from ray_cluster_ft.allocate import make_plan
    from ray_cluster_ft.pipeline.report import write_report

    row = {"instruction": "Summarize the following paragraph.", "input": "Cats sleep a lot.", "output": "Cats nap."}
    ids, labels, _ = tokenize_rows([canonical_row(row)[1]], demo_tokenizer, 512)[0]
    shown = marked_text(demo_tokenizer, ids, labels)
    assert shown == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                     "<|im_end|>\n<|im_start|>user\nSummarize the following paragraph.\n\nCats sleep a lot.<|im_end|>\n"
                     "<|im_start|>assistant\n[[Cats nap.<|im_end|>\n]]")
    plan = make_plan(np.array([f"e{i}" for i in range(8)]), np.arange(8) % 2, np.full(8, 10), 2, 2).plan
    manifest = {"counts": {k: 8 for k in ("read", "accepted", "selected", "trained")} | {
                    "rejected": 0, "held_out": 0, "not_selected": 0},
                "timings_s": {"total": 1.0}, "eval": {"before": {}, "after": {}},
                "data_files": {"/d/a.jsonl": {"rows": 5, "formats": {"alpaca": 4, "prompt_response": 1},
                                              "unused_fields": {"note": 2}}}}
    report = write_report(tmp_path, manifest, plan, None, np.arange(8), trained_examples=[shown]).read_text()
    section = report.split("## What is trained\n", 1)[1].split("\n## ", 1)[0]
    assert "| `/d/a.jsonl` | 5 | alpaca (4), prompt_response (1) | note (2) |" in section
    assert f"```\n{shown}\n```" in section


def test_extra_held_out_files_name_their_unused_fields(tmp_path):
    from ray_cluster_ft.allocate import make_plan
    from ray_cluster_ft.pipeline.report import write_report

    plan = make_plan(np.array([f"e{i}" for i in range(8)]), np.arange(8) % 2, np.full(8, 10), 2, 2).plan
    files = {"/x/a.jsonl": {"rows": 3, "formats": {"prompt_response": 3}, "unused_fields": {"input": 2}},
             "/x/b.jsonl": {"rows": 1, "formats": {"alpaca": 1}, "unused_fields": {}}}
    manifest = {"counts": {k: 8 for k in ("read", "accepted", "selected", "trained")} | {
                    "rejected": 0, "held_out": 0, "not_selected": 0},
                "timings_s": {"total": 1.0}, "eval": {"before": {}, "after": {}},
                "eval_files": {"/x/*.jsonl": {"read": 4, "scored": 4, "rejected": 0, "overlap_with_candidates": 0,
                                              "data_files": files, "before": {}, "after": {}}}}
    report = write_report(tmp_path, manifest, plan, None, np.arange(8)).read_text()
    section = report.split("## Extra held-out files (`evaluation.paths`)\n", 1)[1].split("\n## ", 1)[0]
    assert ("Text fields of these files that their row format does not use, so not scored (`data.unused_fields`; "
            "rows): `/x/a.jsonl`: input (2).") in section


def test_the_counts_name_the_settings_that_chose_the_rows(tmp_path):
    from ray_cluster_ft.allocate import make_plan
    from ray_cluster_ft.config import parse_config
    from ray_cluster_ft.pipeline.report import write_report

    plan = make_plan(np.array([f"e{i}" for i in range(8)]), np.arange(8) % 2, np.full(8, 10), 2, 2).plan
    counts = {k: 8 for k in ("read", "accepted", "selected", "trained")} | {"rejected": 0, "held_out": 0,
                                                                            "not_selected": 0}
    base = {"counts": counts, "timings_s": {"total": 1.0}, "eval": {"before": {}, "after": {}}}
    cases = [({"selection": {"size_power": 0.5}}, {"groups": [0, 1, 1, 0]},
              "Selection: `balanced` on `sketch.method: embedding` features, within clusters `random`, groups `auto` "
              "(2 made), size_power 0.5, budget 0.31 of the candidates."),
             ({"selection": {"groups": None, "budget": 20}}, {},
              "Selection: `balanced` on `sketch.method: embedding` features, within clusters `random`, groups `null` "
              "(every cluster one share), size_power 0.0, budget 20 rows."),
             ({"selection": {"strategy": "random", "budget_tokens": 900}}, {},
              "Selection: `random`, budget 900 tokens."),
             ({"selection": {"budget_tokens": 0.3}, "sketch": {"method": "sketch"}}, {"groups": [0]},
              "Selection: `balanced` on `sketch.method: sketch` features, within clusters `random`, groups `auto` "
              "(1 made), size_power 0.0, budget 0.3 of the candidates' tokens."),
             ({"preset": "cluster-paper"}, {},
              "Selection: `equalize` on `sketch.method: last_layer` features, within clusters `peripheral`, "
              "ratio 1.0.")]
    for raw, budget, want in cases:
        cfg = parse_config(raw).model_dump(mode="json")
        report = write_report(tmp_path, base | {"config": cfg, "budget": budget}, plan, None, np.arange(8))
        assert want in report.read_text().split("## Counts\n", 1)[1].split("\n## ", 1)[0], raw
    assert "Selection:" not in write_report(tmp_path, base, plan, None, np.arange(8)).read_text()  # no config
