"""Output health in the harness (issue 28 item 4): the figures on crafted text, brute force
beside the fast search, the bounds, and whole domain-cell runs against a scripted OpenAI server
that answers healthy text (the run passes its bounds) or a loop (it fails them, rows kept). The
same check against the random-weight model on the cpu engine is in tests/test_bench_server.py."""
from __future__ import annotations

import json
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from qpn.benchmarks import domain_cells, health
from qpn.benchmarks.prompts import CELLS
from qpn.benchmarks.results import read_results

pytestmark = pytest.mark.fast


def _brute_longest_repeat(words):
    best = 0
    for i in range(len(words)):
        for j in range(i + 1, len(words)):
            k = 0
            while j + k < len(words) and words[i + k] == words[j + k]:
                k += 1
            best = max(best, k)
    return best


def test_longest_repeat_is_the_brute_force_answer():
    rng = random.Random(5)
    for _ in range(300):
        words = [rng.choice("abcd"[: rng.randint(1, 4)]) for _ in range(rng.randint(0, 30))]
        assert health.longest_repeat(words) == _brute_longest_repeat(words), words


def test_figures_on_healthy_and_broken_text():
    prose = ("The keeper climbed the stairs at dusk, counted the rusted steps, and found the bottle "
             "wedged between two stones where the tide had left it.")
    good = health.answer_health(prose, "stop")
    assert good == {"natural_stop": True, "replacement_rate": 0.0, "distinct_4grams": 1.0, "longest_repeat": 1}
    loop = health.answer_health("the cat sat " * 20, "length")
    assert loop["natural_stop"] is False and loop["distinct_4grams"] == pytest.approx(3 / 57)
    assert loop["longest_repeat"] == 57
    broken = health.answer_health("ab\ufffdcd\ufffd", "stop")
    assert broken["replacement_rate"] == pytest.approx(2 / 6)
    assert health.answer_health("", None) == {"natural_stop": False, "replacement_rate": 0.0,
                                              "distinct_4grams": 1.0, "longest_repeat": 0}


def test_bounds_parse_and_name_what_is_wrong():
    bounds = health.parse_bounds("natural_stop>=1, longest_repeat<=40,distinct_4grams>=0.5")
    assert [str(b) for b in bounds] == ["natural_stop>=1", "longest_repeat<=40", "distinct_4grams>=0.5"]
    for bad, word in [("natural_stop>1", "FIGURE>=VALUE"), ("speed>=3", "unknown health figure"), ("", "no bound")]:
        with pytest.raises(ValueError, match=word):
            health.parse_bounds(bad)


def test_violations_are_per_cell_means_at_both_ends():
    rows = [{"cell": "a", "natural_stop": True, "longest_repeat": 40},
            {"cell": "a", "natural_stop": False, "longest_repeat": 40},
            {"cell": "b", "natural_stop": True, "longest_repeat": 41}]
    assert health.violations(rows, health.parse_bounds("natural_stop>=0.5,longest_repeat<=40")) == [
        "b: longest_repeat 41 breaks longest_repeat<=40 (1 row(s))"]
    assert health.violations(rows, health.parse_bounds("natural_stop>=0.51")) == [
        "a: natural_stop 0.5 breaks natural_stop>=0.51 (2 row(s))"]
    assert health.violations([{"seed": 1}], health.parse_bounds("natural_stop>=1")) == [
        "all: natural_stop not measured"]


def test_the_fifty_item_cell_counts_distinct_entries():
    names = [f"Name{i}" for i in range(50)]
    check = CELLS["distinct50"].check
    assert check("\n".join(names)).status == "pass"
    assert check("\n".join(f"{i + 1}. {n}" for i, n in enumerate(names))).status == "pass"
    broken = check("\n".join(["Aria", "Bran", "Cael", "Dorn"] + ["Aria"] * 46))  # seed 002's shape
    assert broken.status == "fail" and "4 distinct of 50" in broken.detail and "'aria' x47" in broken.detail
    assert check("\n".join(names[:49])).status == "fail"
    assert check("\n".join(names + ["name3"])).status == "fail"  # case-insensitive repeat


# ---- a whole run against a scripted server ----------------------------------------------------

def _answer_for(prompt: str, healthy: bool) -> tuple[str, str]:
    if not healthy:
        return "and then the keeper and then the keeper " * 12, "length"
    if "different given names" in prompt:
        return "\n".join(f"Name{i}" for i in range(50)), "stop"
    rng = random.Random(len(prompt))
    return " ".join(f"w{rng.randrange(10**6)}" for _ in range(120)), "stop"


class ScriptedServer:
    """Enough of an OpenAI server for the harness: /v1/models, /version, a streamed chat."""

    def __init__(self, healthy: bool):
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _json(self, obj, code=200):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._json({"data": [{"id": "fake", "max_model_len": 4096}]})
                elif self.path == "/version":
                    self._json({"version": "scripted"})
                else:
                    self._json({"error": "not here"}, 404)

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                text, finish = _answer_for(req["messages"][-1]["content"], outer.healthy)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                pieces = [text[i:i + 16] for i in range(0, len(text), 16)]
                for i, piece in enumerate(pieces):
                    choice = {"delta": {"content": piece}, "finish_reason": finish if i == len(pieces) - 1 else None}
                    self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
                usage = {"prompt_tokens": 10, "completion_tokens": len(pieces)}
                self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())

        self.healthy = healthy
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


BOUNDS = "natural_stop>=1,distinct_4grams>=0.9,replacement_rate<=0.001,longest_repeat<=8"


@pytest.mark.parametrize("healthy", [True, False], ids=["healthy", "loop"])
def test_a_run_passes_or_fails_its_health_bounds(tmp_path, capsys, healthy):
    server = ScriptedServer(healthy)
    try:
        code = domain_cells.main(["--base-url", server.base_url, "--model", "fake", "--no-metrics",
                                  "--warmup", "0", "--cells", "prose,distinct50", "--results-dir", str(tmp_path),
                                  "--name", "run", "--hardware", "scripted server", "--min-health", BOUNDS])
    finally:
        server.close()
    header, rows, trailing = read_results(str(tmp_path / "run.csv"))
    assert [r["cell"] for r in rows] == ["prose", "distinct50"]  # rows kept either way
    for figure in health.FIGURES:
        assert all(r[figure] != "" for r in rows), figure
    md = (tmp_path / "run.md").read_text()
    assert "distinct 4-grams" in md and "longest repeat (words)" in md
    err = capsys.readouterr().err
    if healthy:
        assert code == 0, err
        assert rows[1]["check"] == "pass" and all(r["natural_stop"] == "True" for r in rows)
    else:
        assert code == 3
        assert "prose: natural_stop 0 breaks natural_stop>=1" in err
        assert "distinct50: longest_repeat" in err and "breaks longest_repeat<=8" in err
        assert trailing and trailing[-1].startswith("error: output health below --min-health")
        assert "Run stopped early" in md and rows[1]["check"] == "fail"
