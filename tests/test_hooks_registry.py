"""The hook registry is complete: every entry says what, why, how and when it goes, and loads."""
from __future__ import annotations

import pytest

from qpn.fork_patches.engine.hooks import REGISTRY, as_markdown

# The one-minute tier (pytest -m fast): nothing here boots an engine, builds a venv or downloads.
pytestmark = pytest.mark.fast


def test_names_are_unique():
    names = [h.name for h in REGISTRY]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("hook", REGISTRY, ids=lambda h: h.name)
def test_every_hook_is_documented_and_loads(hook):
    assert hook.kind in {"runtime", "disk"}
    for field in ("anchor", "what", "why", "how", "remove_when"):
        assert len(getattr(hook, field).strip()) > 10, f"{hook.name}: {field} is empty"
    assert set(hook.engines) <= {"sm70", "cpu"} and hook.engines
    assert callable(hook.load())
    if hook.kind == "disk":
        assert hook.anchor.endswith(".py") and not hook.anchor.startswith("/")
    else:
        module, _, attr = hook.anchor.partition(":")
        assert module.startswith("vllm.") and attr


def test_markdown_table_reads_back_as_the_registry():
    """Each row of the table, split at its unescaped pipes, gives back its hook's fields in
    order: a field dropped, swapped or left with a raw '|' (which would split a cell) fails."""
    import re

    rows = as_markdown().splitlines()[2:]
    assert len(rows) == len(REGISTRY)
    for row, h in zip(rows, REGISTRY):
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", row)[1:-1]]
        assert len(cells) == 8, row
        assert cells[0] == h.name and cells[1] == h.kind
        assert cells[2].startswith(", ".join(h.engines))
        assert all(f"not on {k}: {v}" in cells[2] for k, v in h.not_on.items())
        assert cells[3].startswith(f"`{h.anchor}`") and all(f"{k}: `{v}`" in cells[3] for k, v in h.anchors.items())
        assert cells[4:] == [h.what, h.why, h.how, h.remove_when], h.name


def test_docs_hooks_md_is_the_registry_table(repo_root):
    doc = (repo_root / "docs" / "hooks.md").read_text()
    assert doc.endswith("\n\n" + as_markdown()), \
        "docs/hooks.md is stale: rewrite its table with `python -m qpn.fork_patches.engine.hooks`"
