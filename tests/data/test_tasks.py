"""``task_fields`` names exactly the fields ``task_from_row`` reads, for every kind of task and for none."""

import pytest

from ray_cluster_ft.data.tasks import task_fields, task_from_row

MBPP = {"tests": ["assert add(1, 2) == 3"]}
HUMAN = {"test": "def check(candidate):\n    assert candidate(1) == 2", "entry_point": "inc"}


@pytest.mark.parametrize(("row", "fields", "task"), [
    ({"choices": ["x", "y"], "gold": "b"}, ("choices", "gold"), {"kind": "mc", "choices": ["A", "B"], "gold": 1}),
    ({"choices": ["x", "y", "z"], "gold": 2}, ("choices", "gold"), {"kind": "mc", "choices": ["A", "B", "C"], "gold": 2}),
    (MBPP, ("tests",), {"kind": "code", "prefix": "", "tests": "assert add(1, 2) == 3"}),
    ({**MBPP, "test_setup_code": "import math", "code_prefix": "def add("}, ("tests", "test_setup_code", "code_prefix"),
     {"kind": "code", "prefix": "def add(", "tests": "import math\nassert add(1, 2) == 3"}),
    ({**MBPP, "test_setup_code": ["import math"]}, ("tests",),  # not a string: not read, so not used
     {"kind": "code", "prefix": "", "tests": "assert add(1, 2) == 3"}),
    (HUMAN, ("test", "entry_point"), {"kind": "code", "prefix": "", "tests": f"{HUMAN['test']}\n\ncheck(inc)\n"}),
    ({**HUMAN, "code_prefix": "def inc(x):\n"}, ("test", "entry_point", "code_prefix"),
     {"kind": "code", "prefix": "def inc(x):\n", "tests": f"{HUMAN['test']}\n\ncheck(inc)\n"}),
    ({"choices": ["x", "y"], "gold": 5, **MBPP}, ("tests",),  # a gold out of range is no MC item: the code task
     {"kind": "code", "prefix": "", "tests": "assert add(1, 2) == 3"}),
    ({"tests": "assert add(1, 2) == 3", "code_prefix": "x"}, (), None),  # a string, not a list: no task
    ({"test": "check", "entry_point": "not an identifier"}, (), None),
    ({"choices": ["only one"], "gold": 0}, (), None),
])
def test_task_fields_are_the_fields_the_task_reads(row, fields, task):
    assert task_from_row(row) == task and task_fields(row) == fields
    if task is not None:  # the task is built from those fields alone
        assert task_from_row({k: row[k] for k in fields}) == task
