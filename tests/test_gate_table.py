"""The boot gates as one table (issue 26 item 4): every gate is one entry of boot_gates.GATES with
an expectation per engine; the census summary they read is typed and versioned
(census_schema.CensusSummary); a new gate is one entry; the docs list the table's gates in its
order. The verdicts of each gate are tested in tests/test_launcher_units.py and
tests/test_census_gates.py."""
from __future__ import annotations

import re

import pytest

from qpn.fork_patches.route_census.census_schema import (
    SUMMARY_VERSION, CensusSchemaError, CensusSummary,
)
from qpn.scripts.launcher import boot_gates as bg
from qpn.scripts.launcher.engine_profiles import CPU, PROFILES, SM70

pytestmark = pytest.mark.fast
from tests._ci import REPO  # noqa: E402
WARM_OK = {"ok": True, "completion_tokens": 4}


def _metrics(k: int) -> str:
    lines = [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}} 0.0'
             for i in range(k)]
    lines += ["vllm:spec_decode_num_drafts_total 3.0",
              f"vllm:spec_decode_num_draft_tokens_total {3.0 * k}"]
    return "\n".join(lines) + "\n"


def _good_cpu_summary() -> dict:
    return {
        "summary_version": SUMMARY_VERSION,
        "ranks": [{"rank": 0, "platform": "cpu", "backend": "reference", "tensor_parallel_size": 1,
                   "quant_config": "qpn", "modules_total": 1, "modules_on_qpn": 1}],
        "modules_by_region": {"nvfp4": 1}, "modules_on_qpn": 1, "modules_total": 1,
        "route_counts": {"qpn2": {"eager": 3, "graph": 0, "m_min": 1, "m_max": 8}},
        "lm_head": [{"module": "lm_head", "region": "nvfp4", "source": "checkpoint_codes",
                     "route_family": "qpn2", "repack_fallback": False}],
        "kv_resolved": [{"checkpoint_requested": None, "resolved": "auto", "policy": "x"}],
    }


def test_every_gate_states_what_it_expects_on_every_engine():
    assert len({g.name for g in bg.GATES}) == len(bg.GATES)
    for gate in bg.GATES:
        assert set(gate.expect) == set(PROFILES), gate.name
        for engine, expect in gate.expect.items():
            assert expect.applies or expect.why_not, f"{gate.name} on {engine}: n/a without a reason"
    # the hooks gate is a row of the table like the others, not printed after it
    assert bg.GATE_ORDER[-1] == bg.GATE_SKIPPED_HOOKS
    results = bg.evaluate(CPU, 2, WARM_OK, _metrics(2), _good_cpu_summary(), {"nvfp4"},
                          qpn_claim="modelopt_mixed")
    assert [r.name for r in results] == list(bg.GATE_ORDER)
    assert not any(r.failed for r in results), bg.format_table(results)


def test_a_gate_without_an_expectation_for_the_engine_is_an_error():
    lonely = bg.Gate("cpu_only", {"cpu": bg.GateExpectation()},
                     lambda i, e: bg.GateResult("cpu_only", bg.PASS, "-", "-"), reads_census=False)
    inputs = bg.GateInputs(k=0, warm=WARM_OK, metrics_text="", census=CensusSummary())
    assert bg.apply_gates(CPU, inputs, (lonely,))[0].status == bg.PASS
    with pytest.raises(KeyError, match="cpu_only.*sm70"):
        bg.apply_gates(SM70, inputs, (lonely,))


def test_a_new_gate_is_one_entry():
    def few_ranks(i, e):
        ok = len(i.census.ranks) >= e.expected
        return bg.GateResult("rank_count", bg.PASS if ok else bg.FAIL, f">= {e.expected} ranks",
                             f"{len(i.census.ranks)} ranks")

    extra = bg.Gate("rank_count", {"cpu": bg.GateExpectation(expected=2),
                                   "sm70": bg.GateExpectation(False, None, "not here")}, few_ranks)
    summary = CensusSummary.from_dict(_good_cpu_summary())
    inputs = bg.GateInputs(k=2, warm=WARM_OK, metrics_text=_metrics(2), census=summary,
                           regions=frozenset({"nvfp4"}), known_routes=bg.qpn_route_names(),
                           qpn_claim="modelopt_mixed")
    cpu = bg.apply_gates(CPU, inputs, bg.GATES + (extra,))
    assert cpu[-1].name == "rank_count" and cpu[-1].failed and cpu[-1].observed == "1 ranks"
    assert not any(r.failed for r in cpu[:-1])
    sm70 = bg.apply_gates(SM70, inputs, bg.GATES + (extra,))
    assert (sm70[-1].status, sm70[-1].expected) == (bg.NA, "not here")


@pytest.mark.parametrize("bad,field", [
    ({"summary_version": SUMMARY_VERSION + 1}, "version"),
    ({"modules_total": "5"}, "modules_total"),
    ({"ranks": [{"rank": 0, "platfrom": "cpu"}]}, "platfrom"),
    ({"ranks": [{"platform": "cpu"}]}, "rank"),
    ({"route_counts": {"qpn2": 3}}, "route_counts"),
    ({"modules_on_qpm": 1}, "modules_on_qpm"),
])
def test_a_summary_that_does_not_validate_fails_every_census_gate_naming_the_field(bad, field):
    summary = {**_good_cpu_summary(), **bad}
    with pytest.raises(CensusSchemaError, match=field):
        CensusSummary.from_dict(summary)
    results = {r.name: r for r in bg.evaluate(CPU, 2, WARM_OK, _metrics(2), summary, {"nvfp4"})}
    census_gates = [g.name for g in bg.GATES if g.reads_census]
    assert census_gates and all(results[n].failed and field in results[n].observed
                                for n in census_gates), bg.format_table(list(results.values()))
    assert not results[bg.GATE_WARM].failed and not results[bg.GATE_DEPTH].failed


def test_served_depth_under_auto_on_sm70_reads_the_census_steps_per_depth():
    # 1Cat exports no per-position drafts: under K=auto the gate reads the census summary's
    # steps per drafted depth (summary version 2), which it reads even though it is not a
    # census gate
    auto = bg.AutoDepth((1, 3, 7), short=(30, 7), long=(900, 3))
    inputs = dict(k=7, warm=WARM_OK, metrics_text=_metrics(7), regions=frozenset({"nvfp4"}),
                  known_routes=bg.qpn_route_names(), auto_depth=auto)
    both = CensusSummary.from_dict({**_good_cpu_summary(), "draft_depth_steps": {"7": 3, "3": 8}})
    depth = {r.name: r for r in bg.apply_gates(SM70, bg.GateInputs(census=both, **inputs))}
    assert not depth[bg.GATE_DEPTH].failed, depth[bg.GATE_DEPTH]
    one = CensusSummary.from_dict({**_good_cpu_summary(), "draft_depth_steps": {"7": 11}})
    depth = {r.name: r for r in bg.apply_gates(SM70, bg.GateInputs(census=one, **inputs))}
    assert depth[bg.GATE_DEPTH].failed and "never changed" in depth[bg.GATE_DEPTH].observed
    none = {r.name: r for r in bg.apply_gates(SM70, bg.GateInputs(census=None, **inputs))}
    assert none[bg.GATE_DEPTH].failed and "not active" in none[bg.GATE_DEPTH].observed


def test_the_docs_list_the_gates_of_the_table_in_its_order():
    text = (REPO / "docs" / "serving.md").read_text()
    header = text.index("| gate | source | sm70 | cpu |")
    rows = re.findall(r"^\| `([a-z_]+)` \|", text[header:].split("\n\n", 1)[0], re.M)
    assert rows == list(bg.GATE_ORDER)
