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
from qpn.benchmarks.v100_calibration import THIRD_PARTY_FILES
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
    third_party = {path for _, path in THIRD_PARTY_FILES}  # other repositories' files, cited by repository
    missing = {ref: where for ref, where in cited.items()
               if not ((repo_root / ref).exists() or (ref.startswith(ONECAT_DOCS) and ref in onecat)
                       or ref in third_party)}
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


# ---- the regenerate commands name no machine path (issue 41 item 7)

_ROW = re.compile(r"^\| `(results/[^`]+)` \| .* \| `(.*)` \|$")


def _machine_path_rows(index_text: str) -> list[str]:
    """Each row of the evidence index whose regenerate command names a path of one machine."""
    bad = []
    for line in index_text.splitlines():
        if m := _ROW.match(line):
            command = m.group(2).replace("\\|", "|")
            if paths := results_index.machine_paths(command):
                bad.append(f"{m.group(1)}: {', '.join(paths)} in `{command}`")
    return bad


def test_no_regenerate_command_names_a_machine_path(repo_root):
    """Every command in the index runs from the repository root of any checkout: the interpreter is
    $VENV/bin/python, what the run writes goes to $OUT, outside inputs are named placeholders. A
    results file whose provenance names another path of its machine fails here: record it
    repository-relative (benchmarks/provenance.py) or name the input's placeholder there."""
    text = results_index.render(repo_root)
    assert sum(bool(_ROW.match(ln)) for ln in text.splitlines()) >= 10  # the rows are read
    bad = _machine_path_rows(text)
    assert not bad, "regenerate commands naming a machine path: " + "; ".join(bad)


def test_the_path_check_catches_a_machine_path(tmp_path):
    (tmp_path / "docs").mkdir()
    res = tmp_path / "results"
    res.mkdir()
    (tmp_path / "README.md").write_text("See results/a_h200_20990101.csv and results/b_cpu_20990101.md.\n")
    (res / "a_h200_20990101.csv").write_text(
        "# commit: 1234567\n# command: /opt/torch/.venv/bin/python3 -m qpn.benchmarks.kernel_matched_bench "
        "--sweep /root/out/a_h200_20990101.csv --out /tmp/x/m.csv --targets=/tmp/x/t.md\nm,n\n")
    (res / "b_cpu_20990101.md").write_text(
        "- commit: 89abcde\n- command: QPN_NUMERICS_REPORT=/root/out/b.md /home/u/qpn/.venv-cpu/bin/python -m "
        "pytest /home/u/qpn/tests/test_x.py --checkpoint /data/ckpt --model /root/models/m  (in /home/u/qpn)\n")
    text = results_index.render(tmp_path)
    rows = {m.group(1): m.group(2) for ln in text.splitlines() if (m := _ROW.match(ln))}
    assert rows["results/a_h200_20990101.csv"] == (
        "$VENV/bin/python -m qpn.benchmarks.kernel_matched_bench --sweep $OUT/a_h200_20990101.csv "
        "--out $OUT/m.csv --targets=$OUT/t.md")
    assert rows["results/b_cpu_20990101.md"] == (
        "QPN_NUMERICS_REPORT=$OUT/b.md $VENV/bin/python -m pytest tests/test_x.py --checkpoint $CHECKPOINT "
        "--model /root/models/m")
    assert _machine_path_rows(text) == [  # a path the rendering does not know stays, and fails the check
        "results/b_cpu_20990101.md: /root/models/m in `" + rows["results/b_cpu_20990101.md"] + "`"]
    assert results_index.machine_paths("x --a=~/cache --b '/abs dir' C=/c $OUT/d tests/e.py") == [
        "~/cache", "/abs", "/c"]


def test_every_test_file_is_in_the_contract_map(repo_root):
    """docs/testing.md maps each contract to its tests: a new test file must join the map."""
    doc = (repo_root / "docs" / "testing.md").read_text()
    files = {p.name for p in (repo_root / "tests").glob("test_*.py")}
    named = set(re.findall(r"tests/(test_\w+\.py)", doc))
    assert files - named == set(), f"test files missing from docs/testing.md: {sorted(files - named)}"


# ---- results/ is the evidence index's closure (issue 27 item 4): nothing orphaned, everything proven

import functools  # noqa: E402  (this section's own imports)

from qpn.benchmarks import perf_model  # noqa: E402

_reachable = functools.cache(results_index.reachable)  # one walk of the repository per session


def _results_files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "results").iterdir() if p.is_file() and p.name != Path(results_index.INDEX).name)


def _unproven(root: Path) -> list[str]:
    """Files under results/ that say nothing of how they were made: a data file (csv, md, json) with
    no commit in its provenance block (a session's notes excepted: they are narrative and name their
    data), a plot with no data file beside it, a tool's raw output (txt) no session's notes name, or a
    file of any other kind."""
    kept = {p.name for p in _results_files(root)}
    notes_name = set().union(*(results_index.named_in(p.read_text(errors="replace"), kept)
                               for p in _results_files(root) if results_index.is_notes(p.name)))
    bad = []
    for path in _results_files(root):
        rel = f"results/{path.name}"
        if path.suffix in {".csv", ".md", ".json"}:
            if not results_index.is_notes(path.name) and "commit" not in results_index.provenance(path):
                bad.append(f"{rel}: no commit in its first {results_index.PROVENANCE_LINES} lines")
        elif path.suffix == ".png":
            if not any(path.with_suffix(s).is_file() for s in (".csv", ".md")):
                bad.append(f"{rel}: a plot with no data file beside it")
        elif path.suffix == ".txt":
            if path.name not in notes_name:
                bad.append(f"{rel}: raw tool output that no session's notes name")
        else:
            bad.append(f"{rel}: not a results file (csv, md, json, png, txt)")
    return bad


def test_every_results_file_is_reached_from_the_index(repo_root):
    """Superseded iterations are removed (git keeps them): each file under results/ is cited by the
    docs or a source, or reached from a cited file, and listed in results/README.md."""
    orphans = results_index.orphans(repo_root)
    assert not orphans, ("not reached from the evidence index (superseded iterations: git rm them, or cite "
                         "them): " + ", ".join(orphans))
    kept = _reachable(repo_root)
    index = (repo_root / results_index.INDEX).read_text()
    assert [p for p in kept if f"`{p}`" not in index] == []
    for c in results_index.citations(repo_root):  # every cited file is kept, as cited
        assert c.path in kept or not (repo_root / c.path).is_file(), c
    # the newest file of each series that code looks up is kept
    newest = perf_model.newest_estimate(str(repo_root / "results"))
    assert newest and f"results/{Path(newest).name}" in kept
    for pattern in results_index.SERIES_READ_BY_CODE:
        names = sorted(p.name for p in (repo_root / "results").glob(pattern))
        assert not names or f"results/{names[-1]}" in kept, pattern


def test_the_reachability_check_reports_an_orphan(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "benchmarks").mkdir()
    res = tmp_path / "results"
    res.mkdir()
    (tmp_path / "README.md").write_text("Measured in results/run_h200_20990101.md (the session: "
                                        "results/run_notes_20990101.md).\n")
    (tmp_path / "benchmarks" / "reader.py").write_text('"""reads the newest results/series_*.csv"""\n')
    prov = "# commit: 1234567\n"
    files = {
        "run_h200_20990101.md": prov + "# command: bench --in /x/inputs_20990101.csv\n",  # cited
        "run_h200_20990101.png": "",  # same stem: the cited run's plot
        "inputs_20990101.csv": prov,  # named by the cited run
        "deep_20990101.csv": prov,  # named by what the cited run names: transitive
        "writer_20990101.csv": prov + "# command: bench --out /root/out/run_h200_20990101.md\n",  # wrote it
        "fit_20990101.csv": prov + "# command: model --csv /root/out/run_h200_20990101.md\n",  # only read it
        "run_notes_20990101.md": "Notes on run_h200_20990101.md; ncu in ncu_20990101.txt, sweeps "
                                 "sweep{1,2}_20990101.{csv,md}, numerics in numerics_20990101_abcdef0.md.\n",
        "ncu_20990101.txt": "raw\n",  # named by cited notes only: notes keep nothing they name
        "sweep1_20990101.csv": prov, "sweep2_20990101.md": prov,
        "series_20990101.csv": prov, "series_20990102.csv": prov,  # the reader takes the newest
        "old_iteration_20990101.md": prov + "an earlier run of run_h200_20990101.md\n",  # names a kept file
        "old_notes_20990101.md": "notes on run_h200_20990101.md\n",  # uncited notes on a kept file
    }
    for name, text in files.items():
        (res / name).write_text(text)
    (res / "inputs_20990101.csv").write_text(prov + "# from deep_20990101.csv\n")
    (res / "README.md").write_text(results_index.render(tmp_path))
    orphans = ["results/fit_20990101.csv", "results/ncu_20990101.txt", "results/old_iteration_20990101.md",
               "results/old_notes_20990101.md", "results/series_20990101.csv", "results/sweep1_20990101.csv",
               "results/sweep2_20990101.md"]
    assert results_index.orphans(tmp_path) == orphans
    kept = results_index.reachable(tmp_path)
    assert kept["results/run_h200_20990101.md"] == "cited by README.md"
    assert kept["results/run_notes_20990101.md"] == "cited by README.md"
    assert kept["results/series_20990102.csv"].startswith("newest of results/series_*.csv")
    assert kept["results/deep_20990101.csv"] == "named by results/inputs_20990101.csv"
    assert kept["results/writer_20990101.csv"].startswith("same run as results/run_h200_20990101.md")
    assert all(f"`{p}`" in (res / "README.md").read_text() for p in kept)
    assert results_index.gone(tmp_path) == {"results/run_notes_20990101.md": ["numerics_20990101_abcdef0.md",
                                                                             "sweep1_20990101.md",
                                                                             "sweep2_20990101.csv"]}
    for path in orphans:
        (tmp_path / path).unlink()
    assert results_index.orphans(tmp_path) == []
    # what the kept notes name is in git history now, and the index says so
    missing = ["ncu_20990101.txt", "numerics_20990101_abcdef0.md", "sweep1_20990101.csv", "sweep1_20990101.md",
               "sweep2_20990101.csv", "sweep2_20990101.md"]
    assert results_index.gone(tmp_path) == {"results/run_notes_20990101.md": missing}
    assert f"| `results/run_notes_20990101.md` | {', '.join(missing)} |" in results_index.render(tmp_path)
    (res / "README.md").write_text(results_index.render(tmp_path))
    assert _unproven(tmp_path) == []


def test_every_results_file_has_provenance(repo_root):
    bad = _unproven(repo_root)
    assert not bad, bad


def test_the_provenance_check_reports_what_lacks_it(tmp_path):
    res = tmp_path / "results"
    res.mkdir()
    (res / "good.csv").write_text("# commit: 1234567\nm,n\n")
    (res / "sweep.md").write_text("# a sweep\n\n- **commit**: 89abcde0\n")   # the context sweep's Markdown form
    (res / "fit.json").write_text('{"provenance": {\n  "commit": "89abcde0"}}\n')
    (res / "bold.md").write_text("- **commit**: not a hash\n")
    (res / "bare.csv").write_text("m,n\n1,2\n")  # data, no provenance
    (res / "bare.md").write_text("# a table\n\nA commit of ours fixed it.\n")
    (res / "x_notes_1.md").write_text("narrative on good.csv\n")  # notes: exempt
    (res / "good.png").write_text("")
    (res / "lonely.png").write_text("")  # a plot of no data file
    (res / "loose.txt").write_text("ncu\n")  # raw output no notes name
    (res / "raw.bin").write_text("")
    assert _unproven(tmp_path) == [
        "results/bare.csv: no commit in its first 40 lines", "results/bare.md: no commit in its first 40 lines",
        "results/bold.md: no commit in its first 40 lines", "results/lonely.png: a plot with no data file beside it",
        "results/loose.txt: raw tool output that no session's notes name",
        "results/raw.bin: not a results file (csv, md, json, png, txt)"]
