"""What the docs cite exists (issue 27 item 4): every repository path named in README.md, docs/,
and our Python and shell sources is in the repository (a 1Cat document, ``docs/design/...``, is in
the 1Cat 1.3.0 archive instead); every results file the docs cite has its provenance; and
results/README.md, the evidence index, is current (benchmarks/results_index.py)."""
from __future__ import annotations

import re
import tarfile
from pathlib import Path

import pytest

from qpn.benchmarks import results_index
from tests._ci import onecat_archive

pytestmark = pytest.mark.fast

# a repository path: one of our top-level folders, then a file name with an extension
REPO_PATH = re.compile(r"(?<![\w/.-])((?:docs|results|benchmarks|scripts|kernels|fork_patches|tests)"
                       r"/[\w./-]*\.(?:md|py|csv|png|sh|toml|json|cuh|cu|txt))(?![\w*])|(?<![\w/.-])(DESIGN\.md)")
SKIP_DIRS = {".git", "build", "results", "__pycache__"}
ONECAT_DOCS = "docs/design/"  # 1Cat-vLLM's own design notes, cited from its archive


def _sources(root: Path):
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if rel.parts[0].startswith(".") or SKIP_DIRS & set(rel.parts) or rel.parts[0].endswith(".egg-info"):
            continue
        if path.is_file() and path.suffix in {".py", ".md", ".sh"} and path.name != Path(__file__).name:
            yield path


def cited_paths(root: Path) -> dict[str, list[str]]:
    cited: dict[str, list[str]] = {}
    for path in _sources(root):
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for m in REPO_PATH.finditer(line):
                ref = (m.group(1) or m.group(2)).rstrip(".")
                if "..." in ref:
                    continue  # a pattern the text explains (results/<name>...)
                cited.setdefault(ref, []).append(f"{path.relative_to(root)}:{n}")
    return cited


def test_every_cited_path_exists(repo_root):
    cited = cited_paths(repo_root)
    with tarfile.open(onecat_archive("1.3.0")) as tar:
        onecat = {m.name.split("/", 1)[1] for m in tar if m.isfile() and "/docs/design/" in m.name}
    missing = {ref: where for ref, where in cited.items()
               if not ((repo_root / ref).exists() or (ref.startswith(ONECAT_DOCS) and ref in onecat))}
    assert not missing, "cited but not in the repository (or the 1Cat archive): " + "; ".join(
        f"{ref} ({', '.join(where[:3])})" for ref, where in sorted(missing.items()))


def test_the_check_finds_a_missing_path(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("See docs/hooks.md and DESIGN.md, and `results/x_....md`.\n")
    (tmp_path / "docs" / "hooks.md").write_text("x\n")
    assert set(cited_paths(tmp_path)) == {"docs/hooks.md", "DESIGN.md"}


def test_every_cited_results_file_has_provenance(repo_root):
    bad = []
    for c in results_index.citations(repo_root):
        path = repo_root / c.path
        if not path.is_file():
            bad.append(f"{c.path} (cited at {c.doc}:{c.line}) does not exist")
        elif path.suffix == ".png":
            if not any(path.with_suffix(s).is_file() for s in (".csv", ".md")):
                bad.append(f"{c.path}: a plot with no data file beside it")
        elif not results_index.is_notes(c.path) and "commit" not in results_index.provenance(path):
            bad.append(f"{c.path}: no commit in its first {results_index.PROVENANCE_LINES} lines")
    assert not bad, bad
    assert len({c.path for c in results_index.citations(repo_root)}) >= 10  # the docs do cite results


def test_provenance_reads_the_harness_formats(tmp_path):
    md = tmp_path / "a.md"
    md.write_text("# t\n\nProvenance (written by benchmarks/provenance.py):\n\n- commit: 96ab849845\n"
                  "- command: `python -m x --y`\n")
    csv = tmp_path / "b.csv"
    csv.write_text("# gpu: H200\n# commit: 52551cbd5486e3 (dirty: False)\n# command: python3 -m z\nm,n\n")
    none = tmp_path / "c.md"
    none.write_text("# notes without provenance\n\nA commit of ours fixed it.\n")
    assert results_index.provenance(md) == {"commit": "96ab849845", "command": "python -m x --y"}
    assert results_index.provenance(csv) == {"commit": "52551cbd5486e3", "command": "python3 -m z"}
    assert results_index.provenance(none) == {}


def test_the_evidence_index_is_current(repo_root):
    index = repo_root / results_index.INDEX
    assert index.read_text() == results_index.render(repo_root), \
        "results/README.md is stale: run python -m qpn.benchmarks.results_index from the repository root"


def test_every_test_file_is_in_the_contract_map(repo_root):
    """docs/testing.md maps each contract to its tests: a new test file must join the map."""
    doc = (repo_root / "docs" / "testing.md").read_text()
    files = {p.name for p in (repo_root / "tests").glob("test_*.py")}
    named = set(re.findall(r"tests/(test_\w+\.py)", doc))
    assert files - named == set(), f"test files missing from docs/testing.md: {sorted(files - named)}"
