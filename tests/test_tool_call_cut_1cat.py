"""Tool calls survive a cut (issue 40 item 5) on 1Cat-vLLM 1.2.2 and 1.3.0: in a subprocess on the cpu
engine's interpreter with the 1Cat archive's sources first on the path and our plugin registered
(engine_source.import_check), tests/_onecat_tool_cut_probe.py runs 1Cat's own answer builders,
non-streamed and streamed, on answers cut after complete tool calls. vLLM 0.32's side, and the
sources' shape, are tests/test_tool_call_cut.py."""
from __future__ import annotations

import json

import pytest

from qpn.fork_patches.engine import engine_source
from tests.test_engine_source import REPO, VERSIONS, _archive

THREE = [["a", '{"city": "Paris"}'], ["b", '{"city": "Rome"}'], ["c", '{"city": "Oslo"}']]
CUT = ["a", '{"city": "Ber']


@pytest.mark.engine
@pytest.mark.parametrize("version", VERSIONS)
def test_1cat_answers_keep_complete_calls_and_say_length(version, tmp_path):
    """1Cat's own answer builders, our plugin registered (tests/_onecat_tool_cut_probe.py): three
    complete calls then the limit, as hermes blocks (auto), the pydantic array (required) and a
    named call's arguments. Engine alone: no call (auto: everything in content; named: the cut
    arguments as a call), and streamed tool_calls instead of length. Hooked: the three calls,
    content the text before them, length, streamed and not; an answer that stopped on its own is
    the engine's."""
    engine_dir = engine_source.extract(_archive(version), tmp_path, version)
    probe = (REPO / "tests" / "_onecat_tool_cut_probe.py").read_text()
    result = engine_source.import_check(engine_dir, "sm70", version, extra_code="\n" + probe)
    assert result["register"] == "ok", result["stderr"]
    line = [x for x in result["stdout"].splitlines() if x.startswith("QPN_TOOL_CUT_1CAT ")]
    assert line, result["stderr"]
    out = json.loads(line[0][len("QPN_TOOL_CUT_1CAT "):])
    assert out["chains"] == {"full": ["tool-call-cut-plain"], "stream": ["tool-call-cut-stream"]}
    assert out["required_supported"]  # 1Cat forces hermes calls through the JSON array
    three, cut = THREE, CUT
    cases = out["cases"]
    # the premise: the engine alone
    assert cases["auto"]["engine"]["plain"]["calls"] == [] and "<tool_call>" in cases["auto"]["engine"]["plain"]["content"]
    assert cases["required"]["engine"]["plain"] == {"finish": "length", "content": "", "calls": []}
    assert cases["named"]["engine"]["plain"]["calls"] == [cut]
    assert cases["auto"]["engine"]["stream"]["finish"] == cases["required"]["engine"]["stream"]["finish"] == ["tool_calls"]
    # hooked
    for label, content in (("auto", "Sure. "), ("required", "")):
        assert cases[label]["hooked"]["plain"] == {"finish": "length", "content": content, "calls": three}, label
        assert cases[label]["hooked"]["stream"] == {"finish": ["length"], "content": content, "calls": three + [cut]}
    assert cases["named"]["hooked"]["plain"] == {"finish": "length", "content": "", "calls": []}
    assert cases["named"]["hooked"]["stream"] == {"finish": ["length"], "content": "", "calls": [cut]}
    for label, row in cases.items():
        assert row["stop"]["hooked"] == row["stop"]["engine"], label
