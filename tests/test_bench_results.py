"""Results files and provenance of the benchmark harness (no server needed)."""
import csv
import io

import pytest

from qpn.benchmarks import provenance
from qpn.benchmarks.prompts import CELLS, extract_json
from qpn.benchmarks.results import Column, ResultsWriter, read_results

# The one-minute tier (pytest -m fast): nothing here boots an engine, builds a venv or downloads.
pytestmark = pytest.mark.fast

COLS = [Column("cell", "cell"), Column("tok_s", "tok/s", 2), Column("note", "note")]


def test_every_row_is_on_disk_as_soon_as_it_is_added(tmp_path):
    w = ResultsWriter(str(tmp_path / "r"), "Title", {"endpoint": "http://x/v1", "K": "3"}, COLS)
    header, rows, trailing = read_results(w.csv_path)
    assert header == {"endpoint": "http://x/v1", "K": "3"} and rows == [] and trailing == []
    w.add_row({"cell": "doc2json", "tok_s": 123.456789, "note": "a, b | c"})
    header, rows, _ = read_results(w.csv_path)  # read back before the writer is done
    assert rows == [{"cell": "doc2json", "tok_s": "123.456789", "note": "a, b | c"}]
    md = (tmp_path / "r.md").read_text()
    assert "| doc2json | 123.46 | a, b \\| c |" in md and "- **K**: 3" in md
    w.add_row({"cell": "prose", "tok_s": None, "note": ""})
    w.fail("the stream was cut")
    header, rows, trailing = read_results(w.csv_path)
    assert [r["cell"] for r in rows] == ["doc2json", "prose"] and rows[1]["tok_s"] == ""
    assert trailing == ["error: the stream was cut"]
    md = (tmp_path / "r.md").read_text()
    assert "**Run stopped early:** the stream was cut (2 rows" in md
    # the data part stays a rectangular CSV
    data = [l for l in open(w.csv_path).read().splitlines() if not l.startswith("#")]
    assert {len(r) for r in csv.reader(io.StringIO("\n".join(data)))} == {3}


def test_undeclared_row_keys_are_refused(tmp_path):
    w = ResultsWriter(str(tmp_path / "r"), "T", {}, COLS)
    with pytest.raises(KeyError, match="tokps"):
        w.add_row({"cell": "x", "tokps": 1.0})


def test_remote_endpoint_hardware_is_not_guessed():
    device, text = provenance.hardware("http://203.0.113.7:8000/v1")
    assert device == "unknown" and "--hardware" in text
    device, text = provenance.hardware("http://203.0.113.7:8000/v1", "4x Tesla V100-SXM2-16GB")
    assert device == "gpu" and "given on the command line" in text


def test_local_endpoint_detection():
    assert provenance.is_local_endpoint("http://127.0.0.1:8000/v1")
    assert provenance.is_local_endpoint("http://localhost:8000/v1")
    assert not provenance.is_local_endpoint("http://203.0.113.7:8000/v1")


def test_checkpoint_revision_from_a_hub_snapshot_path():
    rev = "0123456789abcdef0123456789abcdef01234567"
    entry = {"root": f"/hf/models--org--m/snapshots/{rev}"}
    assert provenance.checkpoint_revision(entry).startswith(rev)
    assert "pass --revision" in provenance.checkpoint_revision({"root": "/nonexistent/x"})


def test_cell_checks_accept_good_answers_and_reject_bad_ones():
    good_invoice = '```json\n{"invoice_number": "HV-2291", "total": 408.96}\n```'
    assert CELLS["doc2json"].check(good_invoice).status == "pass"
    assert CELLS["doc2json"].check('{"total": 400}').status == "fail"
    assert CELLS["doc2json"].check("no json").status == "fail"
    assert CELLS["log2json"].check("[" + ",".join(["{}"] * 8) + "]").status == "pass"
    assert CELLS["log2json"].check("[{}]").status == "fail"
    assert CELLS["mergesort"].check("```python\ndef merge_sort(x):\n    return x\n```").status == "pass"
    assert CELLS["mergesort"].check("```python\ndef merge_sort(x) return\n```").status == "fail"
    assert CELLS["math"].check("so \\boxed{130}").status == "pass"
    assert CELLS["math"].check("so \\boxed{131}").status == "fail"
    assert extract_json('text before [1, 2] after') == [1, 2]


def test_listening_pid_finds_the_process_that_owns_a_port():
    import os
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        assert provenance.listening_pid(s.getsockname()[1]) == os.getpid()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert provenance.listening_pid(port) is None  # closed: nobody listens


def test_cuda_torch_detection_reads_the_memory_map():
    import os

    import torch

    expected = torch.version.cuda is not None and torch.cuda.is_available()
    if torch.version.cuda is not None and not expected:
        pytest.skip("CUDA torch without a GPU: libtorch_cuda may be mapped without use")
    assert provenance.process_has_cuda_torch(os.getpid()) is expected
    assert provenance.process_has_cuda_torch(2 ** 22 + 12345) is None  # no such process
