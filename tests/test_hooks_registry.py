"""The hook registry is complete: every entry says what, why, how and when it goes, and loads."""
from __future__ import annotations

import pytest

from qpn.fork_patches.hooks import REGISTRY, as_markdown

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


def test_markdown_table_lists_every_hook():
    table = as_markdown()
    assert all(f"| {h.name} |" in table for h in REGISTRY)


def test_docs_hooks_md_is_the_registry_table(repo_root):
    doc = (repo_root / "docs" / "hooks.md").read_text()
    assert doc.endswith("\n\n" + as_markdown()), \
        "docs/hooks.md is stale: rewrite its table with `python -m qpn.fork_patches.hooks`"
