"""``sketch.max_tokens``: the window of a row a feature is computed from (pure numpy; no Ray, no I/O).

Every method reads at most ``max_tokens`` tokens of a row, so a feature's cost follows the tokens it reads
(docs/design.md, "Features"). The methods that differentiate the loss of response tokens (``sketch``,
``last_layer``) need a response token in the window; the first ``max_tokens`` tokens of a row with a long
prompt hold none, so for them the window is moved to the end of the prompt: its last tokens and the first
``r = min(response length, max(1, max_tokens // 4))`` response tokens.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..data.collate import IGNORE_INDEX

__all__ = ["feature_window", "window_rows"]


def feature_window(labels: np.ndarray, max_tokens: int | None, needs_response: bool) -> tuple[int, int]:
    """The token range ``[start, stop)`` of one row that its feature is computed from.

    * ``max_tokens`` is ``None`` or the row is no longer: the whole row.
    * ``needs_response`` false (``hidden_mean``): the first ``max_tokens`` tokens.
    * ``needs_response`` true (``sketch``, ``last_layer``): the first ``max_tokens`` tokens when one of them at
      a position >= 1 is a response token (a label other than -100: a loss term needs the token before it in
      the window too); otherwise, with ``p`` the first response position and ``L = n - p`` the response length
      (from its first token to the row's end), ``r = min(L, max(1, max_tokens // 4))`` and the window
      ``[p + r - max_tokens, p + r)``: the last ``max_tokens - r`` prompt tokens and the first ``r`` response
      tokens. Since ``p >= max_tokens`` there, the window lies inside the row and holds ``max_tokens`` tokens.

    Args:
        labels: int ``(n,)`` the row's labels, -100 at prompt tokens.
        max_tokens: ``sketch.max_tokens`` (>= 1), or ``None`` for no cap.
        needs_response: the method needs response tokens in the window.

    Returns:
        ``(start, stop)`` with ``0 <= start < stop <= n`` and ``stop - start <= max_tokens`` (a row without
        any response token gets the first ``max_tokens``; the sketchers reject such a row before).

    Raises:
        ValueError: ``max_tokens < 1``.
    """
    n = len(labels)
    if max_tokens is None or n <= max_tokens:
        return 0, n
    if max_tokens < 1:
        raise ValueError(f"feature_window: max_tokens must be >= 1, got {max_tokens}")
    if not needs_response:
        return 0, max_tokens
    labelled = np.flatnonzero(np.asarray(labels)[1:] != IGNORE_INDEX) + 1
    if len(labelled) == 0 or labelled[0] < max_tokens:
        return 0, max_tokens
    p = int(labelled[0])
    r = min(n - p, max(1, max_tokens // 4))
    return p + r - max_tokens, p + r


def window_rows(ids: Sequence[np.ndarray], labels: Sequence[np.ndarray], max_tokens: int | None,
                needs_response: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Every row cut to its :func:`feature_window` (views, no copies; the rows unchanged without a cap).

    Args:
        ids, labels: per row int arrays of equal length.
        max_tokens, needs_response: as :func:`feature_window`.

    Returns:
        ``(ids, labels)``: lists of the windowed rows, in the order given.
    """
    if max_tokens is None:
        return list(ids), list(labels)
    out_ids, out_labels = [], []
    for row, lab in zip(ids, labels):
        lo, hi = feature_window(lab, max_tokens, needs_response)
        out_ids.append(row[lo:hi])
        out_labels.append(lab[lo:hi])
    return out_ids, out_labels
