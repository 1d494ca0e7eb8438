"""The evaluation task a source row carries (a multiple-choice item or a code problem), read from its own fields.

Here, beside the formats, because the data stage needs it too: in an ``evaluation.paths`` file the fields a task
reads are used (scored), not unused text (:func:`task_fields`). The evaluation stage builds its tasks with
:func:`task_from_row` (:func:`ray_cluster_ft.evaluate.eval_tasks`).
"""

from __future__ import annotations

__all__ = ["LETTERS", "task_fields", "task_from_row"]

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
"""The option letters of a multiple-choice item, in order (at most 26 options)."""


def task_from_row(row: dict) -> dict | None:
    """The evaluation task a source row carries, or None.

    * ``choices`` (a list of 2-26 option strings) and ``gold`` (the option's letter, or its 0-based index): a
      multiple-choice item scored on the letters ``A, B, ...``;
    * ``tests`` (a list of assert strings, MBPP) and optional ``test_setup_code``, or ``test`` and
      ``entry_point`` (HumanEval's ``check(candidate)``), each with optional ``code_prefix`` (code the
      completion continues): a code problem.

    Returns:
        ``{"kind": "mc", "choices": ["A", "B", ...], "gold": int}`` or ``{"kind": "code", "prefix": str,
        "tests": str}``; None for a row without (well-formed) task fields.
    """
    return _task(row)[0]


def task_fields(row: dict) -> tuple[str, ...]:
    """The fields of ``row`` that its evaluation task reads (:func:`task_from_row`), in that order; ``()`` for a
    row without a well-formed task (its fields are then not used by any task)."""
    return _task(row)[1]


def _task(row: dict) -> tuple[dict | None, tuple[str, ...]]:
    choices, gold = row.get("choices"), row.get("gold")
    if isinstance(choices, list) and 2 <= len(choices) <= len(LETTERS) and all(isinstance(c, str) for c in choices):
        letters = list(LETTERS[: len(choices)])
        if isinstance(gold, str) and gold.strip().upper() in letters:
            return {"kind": "mc", "choices": letters, "gold": letters.index(gold.strip().upper())}, ("choices", "gold")
        if isinstance(gold, int) and not isinstance(gold, bool) and 0 <= gold < len(choices):
            return {"kind": "mc", "choices": letters, "gold": gold}, ("choices", "gold")
    has_prefix = isinstance(row.get("code_prefix"), str)
    prefix = row["code_prefix"] if has_prefix else ""
    tests = row.get("tests")
    if isinstance(tests, list) and tests and all(isinstance(t, str) and t.strip() for t in tests):
        has_setup = isinstance(row.get("test_setup_code"), str)
        setup = row["test_setup_code"] if has_setup else ""
        used = ("tests", "test_setup_code") if has_setup else ("tests",)
        return ({"kind": "code", "prefix": prefix, "tests": (setup + "\n" if setup.strip() else "") + "\n".join(tests)},
                used + (("code_prefix",) if has_prefix else ()))
    test, entry = row.get("test"), row.get("entry_point")
    if isinstance(test, str) and test.strip() and isinstance(entry, str) and entry.isidentifier():
        return ({"kind": "code", "prefix": prefix, "tests": f"{test}\n\ncheck({entry})\n"},
                ("test", "entry_point") + (("code_prefix",) if has_prefix else ()))
    return None, ()
