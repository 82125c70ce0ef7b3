# SPDX-License-Identifier: MIT
"""The evidence index: which results file backs which claim of README.md and docs/, and the
command that regenerates it, read from the file's own provenance.

    python -m qpn.benchmarks.results_index            # rewrite results/README.md (from the repository root)
    python -m qpn.benchmarks.results_index --check    # exit 1 when results/README.md is stale

A claim is a line of README.md or docs/*.md that names a file under results/. The index lists,
per cited file, where it is cited and what its provenance says (commit, command). A session's
notes (``*_notes_*.md``) are narrative written with the data they name; every other cited file
carries the provenance block the harness writes (benchmarks/provenance.py, or the CSV header of
the kernel benchmarks). tests/test_doc_references.py checks all of it.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path.cwd()  # run from the repository root (the installed package has no README or results)
INDEX = "results/README.md"
RESULT_REF = re.compile(r"results/[A-Za-z0-9_.-]+\.(?:md|csv|png|json)")
_COMMIT = re.compile(r"\bcommit\b[:\s]+([0-9a-f]{7,40})")
_COMMAND = re.compile(r"\bcommand\b:\s*(.+)")
PROVENANCE_LINES = 40


@dataclass(frozen=True)
class Citation:
    doc: str  # README.md or docs/<name>.md
    line: int
    path: str  # results/<file>


def claim_documents(repo: Path = REPO) -> list[Path]:
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def citations(repo: Path = REPO) -> list[Citation]:
    found = []
    for doc in claim_documents(repo):
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for m in RESULT_REF.finditer(line):
                if m.group(0) != INDEX:  # the index itself
                    found.append(Citation(str(doc.relative_to(repo)), n, m.group(0)))
    return found


def is_notes(path: str) -> bool:
    return "_notes_" in Path(path).name


def provenance(path: Path) -> dict[str, str]:
    """``commit`` and ``command`` from the first lines of a results file (absent keys: not found)."""
    head = path.read_text(errors="replace").splitlines()[:PROVENANCE_LINES]
    out: dict[str, str] = {}
    for line in head:
        line = line.lstrip("#-* ").strip()
        if "commit" not in out and (m := _COMMIT.search(line)):
            out["commit"] = m.group(1)
        if "command" not in out and (m := _COMMAND.search(line)):
            out["command"] = m.group(1).strip().strip("`")
    return out


def render(repo: Path = REPO) -> str:
    by_file: dict[str, list[Citation]] = {}
    for c in citations(repo):
        by_file.setdefault(c.path, []).append(c)
    rows = ["| file | cited by | commit | regenerate with |", "|---|---|---|---|"]
    for path in sorted(by_file):
        where = ", ".join(dict.fromkeys(f"{c.doc}:{c.line}" for c in by_file[path]))
        if not (repo / path).is_file():
            rows.append(f"| `{path}` | {where} | **missing** | |")
            continue
        if is_notes(path):
            rows.append(f"| `{path}` | {where} | (session notes) | written with the data files it names |")
            continue
        p = provenance(repo / path)
        command = f"`{p['command']}`".replace("|", "\\|") if "command" in p else "see the file's header"
        rows.append(f"| `{path}` | {where} | {p.get('commit', 'none')[:12]} | {command} |")
    return ("# Evidence index\n\n"
            "Which file under results/ backs which claim of README.md and docs/, where it is cited, and how "
            "to regenerate it (the command its own provenance names). Written by "
            "`python -m qpn.benchmarks.results_index`, not by hand; tests/test_doc_references.py fails when "
            "it is stale, when a cited file is missing, or when a cited data file has no provenance. "
            "Files not listed here are the data behind the listed ones (a notes file names its own) or "
            "earlier iterations, which are not evidence for any current claim.\n\n" + "\n".join(rows) + "\n")


def main(argv: list[str]) -> int:
    index = REPO / INDEX
    text = render()
    if argv and argv[0] == "--check":
        if not index.is_file() or index.read_text() != text:
            print(f"{INDEX} is stale: run python -m qpn.benchmarks.results_index", file=sys.stderr)
            return 1
        return 0
    index.write_text(text)
    print(f"wrote {INDEX} ({len({c.path for c in citations()})} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
