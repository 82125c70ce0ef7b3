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

What stays under results/ is what the index reaches (``reachable``): the files README.md, docs/ and
our sources cite (a pattern such as ``results/perf_model_v100_estimate_*.csv`` cites the newest
file it matches, the one code reading the series takes; ``SERIES_READ_BY_CODE`` lists the series
code looks up without spelling the path; a ``<date>`` placeholder names no file), then, transitively,
what a kept data file names (its data, its inputs) and the other files of a kept file's run (same
stem; a file whose provenance command wrote a kept file). A session's notes are kept only where a
doc or a source cites them, and what they name is not kept on their account: notes tell a session's
story, and the iterations it went through are in git history (the index lists what the kept notes
name that is no longer here). Anything else is a superseded iteration: it is removed, git keeps it.

The regenerate column names no machine path: ``provenance.portable_command`` renders each recorded
command from the repository root, with $VENV/bin/python for the engine's interpreter, $OUT for the
folder the run wrote into and a placeholder per outside input (``provenance.INPUT_PLACEHOLDERS``);
``machine_paths`` finds what is left, and tests/test_doc_references.py fails on it.
"""
from __future__ import annotations

import itertools
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from . import provenance as _provenance

REPO = Path.cwd()  # run from the repository root (the installed package has no README or results)
INDEX = "results/README.md"
RESULT_REF = re.compile(r"results/[A-Za-z0-9_.-]+\.(?:md|csv|png|json)")
# "# commit: sha", "- **commit**: sha" (Markdown) and '"commit": "sha"' (JSON) alike
_COMMIT = re.compile(r"\bcommit\b[\"*]*[:\s]+\"?([0-9a-f]{7,40})")
_COMMAND = re.compile(r"\bcommand\b[\"*]*:\s*(.+)")
PROVENANCE_LINES = 40
# where a source (code, tests, docs) may cite results/: every such file outside results/ itself
SOURCE_SUFFIXES = {".py", ".md", ".sh", ".toml"}
SKIP_PARTS = {".git", "build", "results", "__pycache__"}
# results/<name or pattern>: a name, ``*`` (the newest match), ``{a,b}`` alternatives
# (results/kernel_sm80_depth{1,2}_sweep_...csv); a ``<placeholder>`` names no file
_RESULT_CITE = re.compile(r"results/((?:[A-Za-z0-9_.*<>-]|\{[A-Za-z0-9_,.-]*\})+)")
# a file name inside a results file (notes write names bare, with {a,b} alternatives)
_NAME = re.compile(r"(?<![A-Za-z0-9_.}-])(?:[A-Za-z0-9_.-]|\{[A-Za-z0-9_,.-]*\})*"
                   r"\.(?:md|csv|png|json|txt|\{[a-z,]+\})(?![A-Za-z0-9_])")
_BRACES = re.compile(r"\{([^{}]*)\}")
# series that code reads by looking up their newest file (not spelled results/... in the source)
SERIES_READ_BY_CODE = {
    "perf_model_v100_estimate_*.csv": "benchmarks/perf_model.py newest_estimate() (the bootstrap's sm70 step)",
    "perf_model_v100_calibration_*.csv": "tests/test_v100_calibration.py (the newest committed calibration)",
}


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
    with path.open(errors="replace") as f:
        head = [line.rstrip("\n") for line in itertools.islice(f, PROVENANCE_LINES)]
    out: dict[str, str] = {}
    for line in head:
        line = line.lstrip("#-* ").strip()
        if "commit" not in out and (m := _COMMIT.search(line)):
            out["commit"] = m.group(1)
        if "command" not in out and (m := _COMMAND.search(line)):
            out["command"] = m.group(1).strip().strip("`")
    return out


def source_files(repo: Path = REPO) -> list[Path]:
    """README.md, docs/ and every source outside results/ (code and tests cite results too)."""
    out = []
    for top, dirs, files in os.walk(repo):
        at_root = Path(top) == repo
        dirs[:] = [d for d in dirs if d not in SKIP_PARTS
                   and not (at_root and (d.startswith(".") or d.endswith(".egg-info")))]
        out += [Path(top) / f for f in files if Path(f).suffix in SOURCE_SUFFIXES]
    return sorted(out)


def expand_braces(text: str) -> list[str]:
    m = _BRACES.search(text)
    if not m:
        return [text]
    return [x for alt in m.group(1).split(",") for x in expand_braces(text[:m.start()] + alt + text[m.end():])]


def resolve(ref: str, names: set[str]) -> list[str]:
    """The results files a citation names: each exact name that exists, the newest match of a pattern."""
    ref = ref.rstrip(".")
    if not ref or "..." in ref:  # a pattern the text explains (results/<name>...)
        return []
    out = []
    for one in expand_braces(ref):
        if "<" in one:  # results/read_probe_<gpu>_<date>.csv: how a run names its file, no file
            continue
        if "*" in one:
            pattern = ".*".join(map(re.escape, one.split("*")))
            hits = sorted(n for n in names if re.fullmatch(pattern, n))
            if hits:
                out.append(hits[-1])  # the newest: names carry the date (or a later suffix) in order
        elif one in names:
            out.append(one)
    return out


def named_in(text: str, names: set[str]) -> set[str]:
    return {n for m in _NAME.finditer(text) for n in resolve(m.group(0), names)}


def reachable(repo: Path = REPO) -> dict[str, str]:
    """Every file under results/ the index reaches, ``results/<name>`` -> why it is kept (module doc)."""
    results = repo / "results"
    names = {p.name for p in results.iterdir() if p.is_file()} - {Path(INDEX).name}
    why: dict[str, str] = {}
    todo: list[str] = []

    def keep(name: str, reason: str) -> None:
        if name not in why:
            why[name] = reason
            todo.append(name)

    for src in source_files(repo):  # the file, not the line: an edit elsewhere in it leaves the index current
        where = f"cited by {src.relative_to(repo)}"
        for m in _RESULT_CITE.finditer(src.read_text(errors="replace")):
            for name in resolve(m.group(1), names):
                keep(name, f"newest of results/{m.group(1)}, {where}" if "*" in m.group(1) else where)
    for pattern, reader in SERIES_READ_BY_CODE.items():
        for name in resolve(pattern, names):
            keep(name, f"newest of results/{pattern}, read by {reader}")
    named: dict[str, set[str]] = {}  # read once, when needed: what a results file names

    def names_in(n: str) -> set[str]:
        if n not in named:
            named[n] = (set() if Path(n).suffix == ".png"
                        else named_in((results / n).read_text(errors="replace"), names) - {n})
        return named[n]

    commands = {n: _provenance.command_outputs(provenance(results / n).get("command", "")) & names - {n}
                for n in sorted(names) if Path(n).suffix != ".png"}
    stems: dict[str, list[str]] = {}
    for n in sorted(names):
        stems.setdefault(Path(n).stem, []).append(n)
    while True:
        while todo:
            name = todo.pop(0)
            if not is_notes(name):  # a session's notes keep nothing they name (module doc)
                for other in sorted(names_in(name)):
                    keep(other, f"named by results/{name}")
            for other in stems[Path(name).stem]:
                keep(other, f"same run as results/{name}")
        for n in sorted(names - set(why)):  # a file of the run that wrote a kept file
            if hit := sorted(commands.get(n, set()) & set(why)):
                keep(n, f"same run as results/{hit[0]} (its command wrote it)")
        if not todo:
            return {f"results/{n}": why[n] for n in sorted(why)}


def gone(repo: Path = REPO) -> dict[str, list[str]]:
    """Kept notes -> the results files they name (by dated name) that are not under results/: the
    superseded iterations the session went through (git history has those that were committed)."""
    results = repo / "results"
    names = {p.name for p in results.iterdir() if p.is_file()}
    out = {}
    for path in reachable(repo):
        if not is_notes(path):
            continue
        text = (repo / path).read_text(errors="replace")
        missing = sorted({one for m in _NAME.finditer(text) for one in expand_braces(m.group(0).rstrip("."))
                          if _DATED.search(one) and "*" not in one and "<" not in one and one not in names})
        if missing:
            out[path] = missing
    return out


# a results file's name carries its date: <what>_<YYYYMMDD>[T...|_<commit>].<ext>
_DATED = re.compile(r"_20\d{6}(?:T\d{6}Z|_[0-9a-f]{7})?(?:_\w+)?\.\w+$")
# an absolute path (or one from a home folder) as a word or a KEY= / --option= value
_MACHINE_PATH = re.compile(r"(?:^|[\s=('\"`])((?:/|~/)[^\s'\"`)]*)")


def machine_paths(command: str) -> list[str]:
    """The paths of one machine a rendered command still names (absolute, or under ~)."""
    return _MACHINE_PATH.findall(command)


def orphans(repo: Path = REPO) -> list[str]:
    """Files under results/ the index does not reach: superseded iterations (git keeps them)."""
    kept = reachable(repo)
    return sorted(f"results/{p.name}" for p in (repo / "results").iterdir()
                  if p.is_file() and f"results/{p.name}" not in kept and f"results/{p.name}" != INDEX)


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
        command = (f"`{_provenance.portable_command(p['command'])}`".replace("|", "\\|") if "command" in p
                   else "see the file's header")
        rows.append(f"| `{path}` | {where} | {p.get('commit', 'none')[:12]} | {command} |")
    support = ["| file | kept because |", "|---|---|"]
    support += [f"| `{path}` | {why} |" for path, why in reachable(repo).items() if path not in by_file]
    history = ["| notes | name these files, no longer under results/ |", "|---|---|"]
    history += [f"| `{path}` | {', '.join(missing)} |" for path, missing in gone(repo).items()]
    return ("# Evidence index\n\n"
            "Which file under results/ backs which claim of README.md and docs/, where it is cited, and how "
            "to regenerate it (the command its own provenance names). Written by "
            "`python -m qpn.benchmarks.results_index`, not by hand; tests/test_doc_references.py fails when "
            "it is stale, when a cited file is missing, when a data file under results/ has no provenance, "
            "when a file under results/ is in neither table below, or when a command names a path of one "
            "machine.\n\n"
            "Each command runs from the repository root of a checkout at the commit shown. `$VENV` is the "
            "engine's virtualenv (one with torch's CUDA build for the GPU runs, `.venv-cpu` for the CPU ones), "
            "`$OUT` the folder the run writes into (copy what it wrote to results/ under the name in the first "
            "column); `$CHECKPOINT`, `$SEED_SOURCE`, `$ONECAT_SOURCE` and `$ENGINE_SOURCES` are the inputs the "
            "file's header names (benchmarks/provenance.py, `portable_command`).\n\n" + "\n".join(rows) + "\n\n"
            "## The files behind them\n\n"
            "Kept because code, tests or a source cite them, because a kept data file names them (its data, "
            "its inputs), or because they belong to a kept file's run (benchmarks/results_index.py, "
            "`reachable`). A session's notes are kept where they are cited, and keep nothing they name. "
            "Superseded iterations are removed; git history keeps them (`git log --diff-filter=D -1 -- "
            "results/<name>` names the commit that removed one; its parent holds it).\n\n"
            + "\n".join(support) + "\n"
            + ("\n## Named by kept notes, no longer here\n\n"
               "Iterations a kept session's notes tell of, superseded since (or never committed).\n\n"
               + "\n".join(history) + "\n" if len(history) > 2 else ""))


def main(argv: list[str]) -> int:
    index = REPO / INDEX
    text = render()
    if argv and argv[0] == "--check":
        if not index.is_file() or index.read_text() != text:
            print(f"{INDEX} is stale: run python -m qpn.benchmarks.results_index", file=sys.stderr)
            return 1
        return 0
    index.write_text(text)
    print(f"wrote {INDEX} ({len({c.path for c in citations()})} cited files, {len(reachable())} kept in all)")
    for path in orphans():
        print(f"not reached from the index (a superseded iteration? git rm it): {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
