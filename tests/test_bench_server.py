"""The benchmark harness against a REAL vLLM server on the cpu engine (no fakes).

A tiny plain Qwen3 model with random weights and a locally trained tokenizer is served by
``python -m vllm.entrypoints.openai.api_server`` (tests/_server.py) with no vLLM plugin loaded
(VLLM_PLUGINS=""): these tests are about the harness, not the overlay. Two servers boot, one at
a time: a plain one (no speculation) for the suites and the bad-input checks, killed mid-run
by the last of its tests, and the project's small mixed NVFP4/FP8 checkpoint served through
our plugin with MTP K=3, whose tau/rounds columns must account for every generated token.
Token budgets are tiny to keep CI cheap; the figures only prove the plumbing and are
labelled as CPU figures.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import subprocess
import sys
import time
import urllib.request

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _server import VllmServer, engine_python, free_port  # noqa: E402

from qpn.benchmarks.results import read_results  # noqa: E402

from tests._ci import REPO  # noqa: E402
pytestmark = [pytest.mark.slow, pytest.mark.engine]


def _engine_has(module: str) -> bool:
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([engine_python(), "-c", code]).returncode == 0


if not _engine_has("vllm"):
    pytest.skip(f"no vLLM in the engine python {engine_python()} (set QPN_ENGINE_PYTHON)",
                allow_module_level=True)


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_bench(module: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([engine_python(), "-m", f"qpn.benchmarks.{module}", *args],
                          capture_output=True, text=True, env=_env(), timeout=timeout, cwd=REPO)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tiny_model"))
    subprocess.run([engine_python(), os.path.join(REPO, "tests", "_bench_tiny_model.py"), out],
                   check=True, env=_env(), capture_output=True, timeout=600)
    return out


def _get_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _check_provenance(header: dict, server: VllmServer, k_text: str):
    assert header["endpoint"] == server.base_url
    assert header["model id"] == "tiny"
    assert header["engine version"].startswith(_get_json(server.root_url + "/version")["version"])
    assert header["MML (max model len)"].startswith("2048")
    assert header["K (speculation depth)"].startswith(k_text)
    assert "config.json sha256" in header["checkpoint revision"]
    # the CI machine has no GPU: hardware and figures must say CPU
    assert header["hardware"].startswith("cpu: ")
    assert header["figures"].startswith("CPU figures")
    assert len(header["commit"].split()[0]) == 40 or header["commit"].startswith("volta-qpn")
    assert "qpn.benchmarks." in header["command"] and server.base_url in header["command"]
    assert header["date"][:4].isdigit() and "T" in header["date"]
    assert "top_k" in header["sampling"] and "seed" in header["sampling"]


@pytest.fixture(scope="class")
def plain_server(tiny_model):
    with VllmServer(tiny_model, ["--reasoning-parser", "qwen3", "--no-enable-prefix-caching"],
                    served_model_name="tiny", plugins="") as s:
        yield s


class TestPlainServer:
    @pytest.fixture
    def server(self, plain_server):
        return plain_server

    def test_domain_cells_write_well_formed_results(self, server, tmp_path):
        r = run_bench("domain_cells", "--base-url", server.base_url, "--model", "tiny",
                      "--cells", "doc2json,math", "--max-tokens", "16",
                      "--results-dir", str(tmp_path), "--name", "cells")
        assert r.returncode == 0, r.stderr
        header, rows, trailing = read_results(str(tmp_path / "cells.csv"))
        _check_provenance(header, server, "0: speculation off")
        assert [row["cell"] for row in rows] == ["doc2json", "math"]
        assert trailing == []
        for row in rows:
            assert row["device"] == "cpu" and row["speculation"] == "off"
            gen = int(row["completion_tokens"])
            assert 1 < gen <= 16
            assert row["finish_reason"] in ("length", "stop")
            assert (row["finish_reason"] == "length") == (gen == 16)
            ttft, decode = float(row["ttft_s"]), float(row["decode_s"])
            assert ttft > 0 and decode > 0 and float(row["e2e_s"]) >= decode
            # speculation off: tau 0, one token per round, the two conventions coincide
            assert float(row["tau"]) == 0.0 and float(row["rounds"]) == gen - 1
            # decode_s is written to 6 decimals (results.py); a burst of tokens can make it a
            # few hundred microseconds, so the rate must lie within what that rounding allows
            rate = float(row["tok_s_one_token"])
            assert (gen - 1) / (decode + 5e-7) * (1 - 1e-6) <= rate <= (gen - 1) / max(decode - 5e-7, 1e-9) * (1 + 1e-6), \
                (rate, gen, decode)
            assert float(row["tok_s_round"]) == pytest.approx(float(row["tok_s_one_token"]))
            assert row["check"] in ("pass", "fail")
        # thinking on for the math cell: the reasoning parser routed tokens to `reasoning`
        assert rows[0]["thinking"] == "off" and rows[1]["thinking"] == "on"
        assert int(rows[1]["reasoning_tokens"]) > 0
        md = (tmp_path / "cells.md").read_text()
        assert "CPU figures" in md and "| doc2json |" in md and "| math |" in md

    def test_reasoning_seeds_report_mean_and_sd(self, server, tmp_path):
        r = run_bench("reasoning_seeds", "--base-url", server.base_url, "--model", "tiny",
                      "--seeds", "1001,2002", "--max-tokens", "12",
                      "--results-dir", str(tmp_path), "--name", "reasoning")
        assert r.returncode == 0, r.stderr
        header, rows, trailing = read_results(str(tmp_path / "reasoning.csv"))
        _check_provenance(header, server, "0: speculation off")
        assert "temperature 0.6" in header["sampling"] and "top_k 20" in header["sampling"]
        assert "presence_penalty 1.0" in header["sampling"] and "medium" in header["sampling"]
        assert [row["seed"] for row in rows] == ["1001", "2002"]
        assert all(row["expected"] == "2666" for row in rows)
        # a seed's sampled answer may end within one text chunk (random weights: which seed does
        # depends on the host's float arithmetic); such a row has no decode time, and the
        # summary must count only the seeds that have one
        for row in rows:
            assert (row["decode_s"] == "") == (int(row["text_chunks"]) < 2), row
        secs = [float(row["decode_s"]) for row in rows if row["decode_s"] != ""]
        line = next(t for t in trailing if t.startswith("note: seconds to answer"))
        missing = f"; {2 - len(secs)} of 2 seeds have none" if len(secs) < 2 else ""
        if not secs:
            assert line.endswith(f"no values{missing}"), line
        else:
            mean = sum(secs) / len(secs)
            sd = (f"{math.sqrt(sum((s - mean) ** 2 for s in secs) / (len(secs) - 1)):.2f}"
                  if len(secs) > 1 else "n/a (one value)")
            assert f"{mean:.2f} ± {sd} (mean ± sd, n={len(secs)}{missing})" in line, line
        assert any(t.startswith("note: final answer correct:") for t in trailing)

    def test_plot_makes_a_png(self, server, tmp_path):
        if not _engine_has("matplotlib"):
            pytest.skip("matplotlib missing from the engine python: install volta-qpn[bench]")
        r = run_bench("domain_cells", "--base-url", server.base_url, "--model", "tiny",
                      "--cells", "json", "--max-tokens", "8", "--results-dir", str(tmp_path),
                      "--name", "p")
        assert r.returncode == 0, r.stderr
        p = run_bench("plot", str(tmp_path / "p.csv"))
        assert p.returncode == 0, p.stderr
        png = tmp_path / "p.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000

    def test_context_sweep_runs_llama_benchy_offline(self, server, tmp_path, tiny_model):
        if not _engine_has("llama_benchy"):
            pytest.skip("llama-benchy missing from the engine python: install volta-qpn[bench]")
        r = run_bench("context_sweep", "--base-url", server.base_url, "--model", "tiny",
                      "--tokenizer", tiny_model, "--depths", "0,256", "--pp", "64", "--tg", "32",
                      "--runs", "1", "--results-dir", str(tmp_path), "--name", "ctx")
        assert r.returncode == 0, r.stdout + r.stderr
        header, rows, trailing = read_results(str(tmp_path / "ctx.csv"))
        _check_provenance(header, server, "0: speculation off")
        assert "llama-benchy 0.4.0" in header["driver"]
        assert "served from 127.0.0.1" in header["corpus"]
        assert [int(row["depth"]) for row in rows] == [0, 256]
        assert [int(row["live_context"]) for row in rows] == [64, 320]
        assert all(row["device"] == "cpu" and float(row["e2e_ttft_ms"]) > 0 for row in rows)
        for row in rows:
            # llama-benchy times tokens per network read: when the server's tokens all arrive in
            # one read it reports no tg figure; and it takes prefill as the time to the first
            # response less a latency measured once before the run, which on a busy host can
            # exceed it, leaving no pp figure. Either way the harness must say so, not invent one.
            for fig in ("tg", "pp"):
                if row[f"{fig}_tok_s"]:
                    assert float(row[f"{fig}_tok_s"]) > 0
                else:
                    assert any(f"depth {row['depth']}: llama-benchy reported no {fig} figure" in line
                               for line in trailing), trailing

    def test_context_sweep_names_a_missing_llama_benchy_figure(self, server, tmp_path, tiny_model):
        """A llama-benchy result without a tg or pp figure (what it writes when every token
        arrives in one read, or when its latency estimate swallows the prefill) leaves those cells
        empty and says why per depth; a depth with both figures gets no note."""
        fake = tmp_path / "fake_benchy.py"
        fake.write_text(
            "import json, sys\n"
            "a = sys.argv[1:]\n"
            "if '--version' in a:\n"
            "    print('llama-benchy 0.4.0'); sys.exit(0)\n"
            "depth = int(a[a.index('--depth') + 1])\n"
            "run = {'prompt_size': 64, 'response_size': 32, 'e2e_ttft': {'mean': 40.0, 'std': 0.0}}\n"
            "if depth == 0:\n"
            "    run.update(tg_throughput={'mean': 9.0, 'std': 0.1}, pp_throughput={'mean': 90.0, 'std': 1.0})\n"
            "json.dump({'benchmarks': [run]}, open(a[a.index('--save-result') + 1], 'w'))\n")
        r = run_bench("context_sweep", "--base-url", server.base_url, "--model", "tiny",
                      "--tokenizer", tiny_model, "--depths", "0,256", "--pp", "64", "--tg", "32",
                      "--runs", "1", "--results-dir", str(tmp_path), "--name", "fake",
                      "--llama-benchy", f"{sys.executable} {fake}")
        assert r.returncode == 0, r.stdout + r.stderr
        _, rows, trailing = read_results(str(tmp_path / "fake.csv"))
        assert [(row["tg_tok_s"], row["pp_tok_s"]) for row in rows] == [("9.0", "90.0"), ("", "")]
        notes = [line for line in trailing if "llama-benchy reported no" in line]
        assert len(notes) == 2 and not any("depth 0:" in n for n in notes), trailing
        for fig in ("tg", "pp"):
            assert any(f"depth 256: llama-benchy reported no {fig} figure" in n for n in notes), trailing

    def test_wrong_model_name_is_named_with_the_served_ones(self, server, tmp_path):
        r = run_bench("domain_cells", "--base-url", server.base_url, "--model", "no-such-model",
                      "--results-dir", str(tmp_path))
        assert r.returncode == 2
        assert "'no-such-model' is not served" in r.stderr and "'tiny'" in r.stderr
        assert "--model" in r.stderr

    def test_absent_metrics_endpoint_is_named_with_the_fix(self, server, tmp_path):
        r = run_bench("domain_cells", "--base-url", server.base_url, "--model", "tiny",
                      "--metrics-url", server.root_url + "/no-metrics-here",
                      "--results-dir", str(tmp_path))
        assert r.returncode == 2
        assert "answered HTTP 404" in r.stderr and "--no-metrics" in r.stderr

    def test_no_metrics_flag_leaves_round_figures_empty(self, server, tmp_path):
        r = run_bench("domain_cells", "--base-url", server.base_url, "--model", "tiny",
                      "--no-metrics", "--cells", "prose", "--max-tokens", "8",
                      "--results-dir", str(tmp_path), "--name", "nm")
        assert r.returncode == 0, r.stderr
        header, rows, _ = read_results(str(tmp_path / "nm.csv"))
        assert header["K (speculation depth)"].startswith("unknown")
        assert rows[0]["speculation"] == "unknown" and rows[0]["tau"] == ""
        assert rows[0]["tok_s_round"] == "" and float(rows[0]["tok_s_one_token"]) > 0

    def test_random_weights_fail_the_output_health_check(self, server, tmp_path):
        """The tiny model's weights are random: its greedy text loops and never stops by itself
        within 64 tokens, which --min-health must report (exit 3, rows kept, figures in the CSV).
        tests/test_bench_health.py runs the passing side against a scripted healthy server."""
        r = run_bench("domain_cells", "--base-url", server.base_url, "--model", "tiny",
                      "--no-metrics", "--cells", "prose,distinct50", "--max-tokens", "64",
                      "--results-dir", str(tmp_path), "--name", "health",
                      "--min-health", "natural_stop>=1,distinct_4grams>=0.95,longest_repeat<=3")
        assert r.returncode == 3, r.stderr
        assert "output health below --min-health" in r.stderr
        _, rows, trailing = read_results(str(tmp_path / "health.csv"))
        assert [row["cell"] for row in rows] == ["prose", "distinct50"]
        assert all(row["distinct_4grams"] != "" and row["longest_repeat"] != "" for row in rows)
        assert rows[1]["check"] == "fail"
        assert trailing[-1].startswith("error: output health below --min-health")

    # keep this test last in the class: it kills the class's server
    def test_server_killed_mid_run_keeps_finished_rows(self, server, tmp_path):
        cmd = [engine_python(), "-m", "qpn.benchmarks.domain_cells", "--base-url", server.base_url,
               "--model", "tiny", "--max-tokens", "1400", "--results-dir", str(tmp_path),
               "--name", "killed"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=_env(), cwd=REPO)
        csv_path = tmp_path / "killed.csv"
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and proc.poll() is None:
                if csv_path.exists() and len(read_results(str(csv_path))[1]) >= 1:
                    break
                time.sleep(0.2)
            assert proc.poll() is None, "the run ended before the server could be killed"
            server.kill_hard()
            out, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 2, err
        assert "error: " in err and "rows finished before the error" in err
        assert any(w in err for w in ("the stream from", "stopped answering", "probably died"))
        header, rows, trailing = read_results(str(csv_path))
        assert 1 <= len(rows) < 7
        assert rows[0]["cell"] == "doc2json" and rows[0]["completion_tokens"]
        assert trailing and trailing[-1].startswith("error: ")
        # the CSV is still well-formed: every row has every column
        data = [line for line in csv_path.read_text().splitlines() if not line.startswith("#")]
        parsed = list(csv.reader(io.StringIO("\n".join(data))))
        assert all(len(p) == len(parsed[0]) for p in parsed)
        assert "Run stopped early" in (tmp_path / "killed.md").read_text()


def test_unreachable_server_is_named_with_the_fix(tmp_path):
    port = free_port()  # nothing listens there
    r = run_bench("domain_cells", "--base-url", f"http://127.0.0.1:{port}/v1", "--model", "x",
                  "--results-dir", str(tmp_path))
    assert r.returncode == 2
    assert "cannot reach the server" in r.stderr and "--base-url" in r.stderr
    assert list(tmp_path.iterdir()) == []  # nothing measured, nothing written


@pytest.fixture(scope="class")
def mixed_server(mixed_checkpoint):
    """The project's small mixed NVFP4/FP8 checkpoint (the session's, tests/conftest.py), served
    through our plugin with MTP K=3."""
    out = str(mixed_checkpoint)
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    with VllmServer(out, ["--reasoning-parser", "qwen3", "--no-enable-prefix-caching",
                          "--speculative-config", json.dumps(spec)],
                    served_model_name="qpn-mixed", boot_timeout_s=400) as s:
        yield s


class TestMixedCheckpointWithMtp:
    def test_rounds_and_tau_account_for_every_generated_token(self, mixed_server, tmp_path):
        r = run_bench("domain_cells", "--base-url", mixed_server.base_url, "--model", "qpn-mixed",
                      "--cells", "json", "--max-tokens", "16",
                      "--results-dir", str(tmp_path), "--name", "mixed")
        assert r.returncode == 0, r.stderr
        header, rows, _ = read_results(str(tmp_path / "mixed.csv"))
        assert header["K (speculation depth)"].startswith("3 (from /metrics position labels)")
        assert header["figures"].startswith("CPU figures")
        row = rows[0]
        assert row["speculation"] == "on" and row["device"] == "cpu"
        gen, tau, rounds = int(row["completion_tokens"]), float(row["tau"]), float(row["rounds"])
        # MTP verifies on every decode step: the rounds counted by the server, each emitting
        # tau + 1 tokens on average, carry every token after the first; only the last round
        # can overshoot, when max_tokens cuts it, by at most K = 3 tokens
        assert 0.0 <= tau <= 3.0
        assert gen - 1 - 1e-3 <= rounds * (tau + 1) <= gen - 1 + 3 + 1e-3
