"""The one collate function that training, sketching and evaluation pad with."""

import numpy as np
import pytest

from ray_cluster_ft.data import IGNORE_INDEX, collate
from ray_cluster_ft.data.collate import as_token_rows, logits_positions


def test_right_padding_with_labels():
    out = collate([np.array([5, 6, 7]), np.array([8])], [np.array([-100, 6, 7]), np.array([8])], pad_token_id=2)
    np.testing.assert_array_equal(out["input_ids"], [[5, 6, 7], [8, 2, 2]])
    np.testing.assert_array_equal(out["labels"], [[-100, 6, 7], [8, -100, -100]])
    np.testing.assert_array_equal(out["attention_mask"], [[1, 1, 1], [1, 0, 0]])
    assert all(v.dtype == np.int64 for v in out.values())


def test_left_padding_for_generation_and_no_labels():
    out = collate([[1, 2, 3], [4]], pad_token_id=9, side="left")
    assert set(out) == {"input_ids", "attention_mask"}
    np.testing.assert_array_equal(out["input_ids"], [[1, 2, 3], [9, 9, 4]])
    np.testing.assert_array_equal(out["attention_mask"], [[1, 1, 1], [0, 0, 1]])


def test_padding_never_carries_a_label():
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 100, size=int(n)) for n in rng.integers(1, 12, size=20)]
    out = collate(rows, rows, pad_token_id=0)
    assert (out["labels"][out["attention_mask"] == 0] == IGNORE_INDEX).all()
    for i, r in enumerate(rows):  # every row is intact at the left
        np.testing.assert_array_equal(out["input_ids"][i, : len(r)], r)


def test_bad_batches_are_refused():
    with pytest.raises(ValueError, match="lengths differ"):
        collate([np.array([1, 2])], [np.array([1])], 0)
    with pytest.raises(ValueError, match="equal-count"):
        collate([], [])
    with pytest.raises(ValueError, match="equal-count"):
        collate([[1]], [[1], [2]])
    with pytest.raises(ValueError, match="empty sequence"):
        collate([[1], []])
    with pytest.raises(ValueError, match="side"):
        collate([[1]], side="middle")


def test_as_token_rows_accepts_ragged_and_2d_columns():
    ragged = np.empty(2, dtype=object)
    ragged[0], ragged[1] = np.array([1, 2]), np.array([3])
    assert [r.tolist() for r in as_token_rows(ragged)] == [[1, 2], [3]]
    assert [r.tolist() for r in as_token_rows(np.array([[1, 2], [3, 4]]))] == [[1, 2], [3, 4]]
    bad = np.empty(2, dtype=object)
    bad[0], bad[1] = np.zeros((2, 2)), np.array([1])
    with pytest.raises(ValueError, match="1-D sequence"):
        as_token_rows(bad)
    with pytest.raises(ValueError, match="ragged column or a 2-D array"):
        as_token_rows(np.zeros((2, 2, 2)))


def test_logits_positions_are_the_union_of_the_rows_label_positions():
    labels = np.array([[-100, -100, 5, 6, -100, 7], [-100, 4, -100, -100, -100, -100]])
    np.testing.assert_array_equal(logits_positions(labels), [0, 1, 2, 4])
    assert logits_positions(np.full((2, 3), -100)).tolist() == []
