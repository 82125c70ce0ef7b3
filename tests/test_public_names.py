"""Tests use the code's public names (issue 41 item 6): where a test needs an internal (a cache
to clear, a planner to ask), the code gives it a public, documented name. The check reads every
test file with ``ast`` and flags a leading-underscore name reached through a qpn module: an
attribute of an imported qpn module (``ops._linear``), a name imported from one
(``from qpn.kernels.ops import _linear``), or one patched by string
(``monkeypatch.setattr(ops, "_cache", ...)``)."""
from __future__ import annotations

import ast

import pytest

from tests._ci import REPO

pytestmark = pytest.mark.fast


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(source: str) -> list[str]:
    """'qpn.module._name' for every private name of a qpn module the source reaches."""
    tree = ast.parse(source)
    modules, found = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("qpn"):
            for alias in node.names:
                modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                if _private(alias.name):
                    found.append(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("qpn"):
                    modules[alias.asname or alias.name.split(".")[0]] = alias.asname and alias.name or "qpn"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name) \
                and node.value.id in modules:
            found.append(f"{modules[node.value.id]}.{node.attr}")
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") in ("setattr", "delattr") \
                and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and node.args[0].id in modules \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) \
                and _private(node.args[1].value):
            found.append(f"{modules[node.args[0].id]}.{node.args[1].value}")
    return found


def test_no_test_reaches_a_private_name_of_the_code():
    bad = {str(p.relative_to(REPO)): uses for p in sorted((REPO / "tests").glob("*.py"))
           if (uses := private_uses(p.read_text()))}
    assert not bad, ("tests reach private names of the code; give what they need a public, documented "
                     f"name in the module: {bad}")


@pytest.mark.parametrize("code, caught", [
    ("from qpn.kernels import ops\nops._linear(1)\n", True),
    ("from qpn.kernels.ops import _linear\n", True),
    ("from qpn.kernels import sm80_plan as sp\nmonkeypatch.setattr(sp, '_pdl_names', {})\n", True),
    ("from qpn.kernels import ops\nops.linear_operands(1)\n", False),
    ("import json\njson._default_decoder\n", False),            # not ours
    ("def _helper():\n    pass\n_helper()\n", False),              # the test's own
])
def test_the_check_catches_each_way_of_reaching_a_private_name(code, caught):
    assert bool(private_uses(code)) == caught
