"""benchmarks/code_shape.py: the counts of its before/after table, on hand-made trees."""

from __future__ import annotations

import pytest

from conftest import load_benchmark


@pytest.fixture(scope="module")
def cs():
    return load_benchmark("code_shape")


TREE = {
    "__init__.py": "",
    "io.py": "import json\n",
    "schedules.py": "from headbudget import io\n\ndef f():\n    from headbudget import budget\n    return budget\n",
    "budget.py": "from headbudget.schedules import f\n",  # with schedules' lazy import: one circle
    "cli/__init__.py": "",
    "cli/main.py": "from . import common\nimport argparse\n\ndef g(p):\n    p.add_argument('--x')\n",
    "cli/common.py": "x = 1\ny = 2\n",
}


def test_graph_circles_and_lazy_imports(cs):
    graph, in_functions = cs.import_graph(TREE)
    assert graph["headbudget.schedules"] == {"headbudget.io", "headbudget.budget"}
    assert graph["headbudget.cli.main"] == {"headbudget.cli.common"}  # relative import resolved
    assert in_functions == 1 and cs.circles(graph) == 1
    graph["headbudget.schedules"].discard("headbudget.budget")
    assert cs.circles(graph) == 0


def test_long_functions_and_flag_code(cs):
    body = "".join(f"    x{i} = {i}\n" for i in range(50))
    assert cs.long_functions({"m.py": f"def long():\n{body}\ndef short():\n    pass\n"}, 50) == 1
    assert cs.flag_code(TREE) == 2 + 1  # cli/common.py's lines + one add_argument call elsewhere in cli/


def test_line_kinds_sum_to_the_lines(cs):
    text = ('"""Module.\n\nMore."""\n\n# why\nimport os\n\n\ndef f():\n    """One."""\n    return os  # inline\n')
    kinds = cs.line_kinds(text)
    assert kinds == {"code": 3, "docstring": 4, "comment": 1, "blank": 3}
    assert sum(kinds.values()) == len(text.splitlines())
