"""What each cluster holds (``pipeline/_clusters.py``): exact figures on a small constructed table, the NMI's
end points, the source field chosen, prompts decoded back from tokens, and the report's section."""

from __future__ import annotations

import numpy as np
import pytest

from ray_cluster_ft.pipeline._clusters import cluster_profile, pick_source, prompt_texts


def _table():
    labels = np.array([0, 0, 0, 1, 1, 2, 1, 0])
    source = np.array(["a", "a", "b", "b", "b", "c", "c", "a"])
    n_tokens = np.array([10, 20, 30, 5, 7, 100, 9, 40])
    weight = np.array([1.5, np.nan, 0.5, 2.0, np.nan, 1.0, 2.0, np.nan])  # NaN: not selected
    return labels, source, n_tokens, weight


def test_profile_counts_shares_lengths_and_weights_exactly():
    labels, source, n_tokens, weight = _table()
    out = cluster_profile(labels, n_tokens, selected_weight=weight, source=source, source_field="source",
                          texts=lambda rows: [f"row {r}" for r in rows], seed=3)
    assert out["source_field"] == "source"
    c0, c1, c2 = out["clusters"]
    assert [c["cluster"] for c in out["clusters"]] == [0, 1, 2]
    assert (c0["size"], c0["share"], c0["sources"]) == (4, 0.5, {"a": 0.75, "b": 0.25})
    assert (c1["size"], c1["sources"]) == (3, {"b": 2 / 3, "c": 1 / 3})
    assert c2["sources"] == {"c": 1.0}
    assert (c0["tokens_min"], c0["tokens_max"], c0["tokens_mean"]) == (10, 40, 25.0)
    assert (c1["tokens_min"], c1["tokens_max"], c1["tokens_mean"]) == (5, 9, 7.0)
    assert (c0["selected"], c0["weight"]) == (2, 2.0)
    assert (c1["selected"], c1["weight"]) == (2, 4.0)
    assert (c2["selected"], c2["weight"]) == (1, 1.0)
    # three examples (or all of a smaller cluster), each from its own cluster, the same for the same seed
    members = {c: {f"row {r}" for r in np.flatnonzero(labels == c)} for c in range(3)}
    for c in out["clusters"]:
        assert len(c["examples"]) == min(3, c["size"]) and set(c["examples"]) <= members[c["cluster"]]
    again = cluster_profile(labels, n_tokens, selected_weight=weight, source=source,
                            texts=lambda rows: [f"row {r}" for r in rows], seed=3)
    assert [c["examples"] for c in again["clusters"]] == [c["examples"] for c in out["clusters"]]


def test_nmi_is_one_when_clusters_are_the_sources_and_none_without_a_source():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 4, size=500)
    names = np.array(["mbpp", "medquad", "gpteacher", "humaneval"])
    out = cluster_profile(labels, np.full(500, 3), source=names[(labels + 1) % 4], source_field="source")
    assert out["nmi"] == pytest.approx(1.0)
    assert all(len(c["sources"]) == 1 for c in out["clusters"])
    unrelated = cluster_profile(labels, np.full(500, 3), source=names[rng.integers(0, 4, size=500)])
    assert unrelated["nmi"] < 0.05
    blind = cluster_profile(labels, np.full(500, 3))
    assert blind["nmi"] is None and blind["source_field"] is None and blind["clusters"][0]["sources"] == {}
    assert blind["clusters"][0]["selected"] == 0 and blind["clusters"][0]["examples"] == []
    with pytest.raises(ValueError, match="n_tokens must be"):
        cluster_profile(labels, np.full(3, 1))


def test_pick_source_takes_the_first_field_that_tells_rows_apart():
    assert pick_source({"source": ["f", "f"], "domain": ["code", "medical"]})[0] == "domain"
    name, values = pick_source({"source": ["x", "y"], "domain": ["code", "code"]})
    assert name == "source" and values.tolist() == ["x", "y"]
    assert pick_source({"source": ["f", "f"], "domain": ["default", "default"]}) == (None, None)


def test_prompt_texts_decode_the_user_prompt_without_the_template(tiny_model_dir):
    import pyarrow as pa
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = []
    for prompt, answer in (("Write a function that adds two numbers.", "def add(a, b): return a + b"),
                           ("What are the symptoms of anemia?", "Fatigue and pale skin.")):
        p = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True, add_generation_prompt=True)
        p = list(p["input_ids"] if hasattr(p, "keys") else p)
        a = tok(answer, add_special_tokens=False)["input_ids"]
        rows.append((p + a, [-100] * len(p) + a))
    table = pa.table({"input_ids": [r[0] for r in rows], "labels": [r[1] for r in rows]})
    assert prompt_texts(table, tok)(np.array([1, 0])) == ["What are the symptoms of anemia?",
                                                          "Write a function that adds two numbers."]


def test_prompt_texts_drop_the_template_when_the_response_takes_its_last_newline(tiny_model_dir):
    """A code response opening with a newline and indentation is tokenised with the template's last newline (as
    the data stage does for HumanEval rows): the prompt part then ends at ``assistant`` without it."""
    import pyarrow as pa
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rendered = tok.apply_chat_template([{"role": "user", "content": "Complete add(a, b)."}], tokenize=False,
                                       add_generation_prompt=True)
    assert rendered.endswith("assistant\n")
    p = tok(rendered.rstrip("\n"), add_special_tokens=False)["input_ids"]
    a = tok("\n    return a + b", add_special_tokens=False)["input_ids"]
    table = pa.table({"input_ids": [p + a], "labels": [[-100] * len(p) + a]})
    assert prompt_texts(table, tok)(np.array([0])) == ["Complete add(a, b)."]
