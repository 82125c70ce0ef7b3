"""K=auto on 1Cat-vLLM (issue 28): the auto-depth hooks on 1Cat's real classes, on each locked
version. In a subprocess on the cpu engine's interpreter with the 1Cat archive's sources first on
the path and our plugin registered (engine_source.import_check), tests/_onecat_depth_probe.py runs
1Cat's own SpecDecodeBaseProposer.propose (models and metadata stood in) at a depth that changes
from call to call, and 1Cat's own AsyncScheduler._update_after_schedule for a request whose live
context crosses the policy's threshold. What must hold: the drafter runs exactly d forwards
(positions >= d never drafted) and returns the K columns 1Cat's runner indexes, the last drafted
token filling the rest; num_speculative_tokens is restored; the step's depth survives the pickle
the executor sends to every rank; the async scheduler still books K placeholders (the verify width
stays a fixed-K server's); acceptance is counted only for the positions drafted. The same hooks
over stand-ins, and the launcher's side, are tests/test_auto_depth.py."""
from __future__ import annotations

import json

import pytest

from qpn.fork_patches.engine import engine_source
from qpn.fork_patches.engine.hooks import hooks_for
from tests.test_engine_source import VERSIONS, _archive

from tests._ci import REPO  # noqa: E402
K = 7


def _filled(depth: int) -> list[list[int]]:
    return [[100 * (min(j, depth - 1) + 1) + i for j in range(K)] for i in range(3)]


@pytest.mark.engine
@pytest.mark.parametrize("version", VERSIONS)
def test_1cat_drafts_the_steps_depth_through_its_own_proposer_and_scheduler(version, tmp_path):
    engine_dir = engine_source.extract(_archive(version), tmp_path / "engine", version)
    probe = (REPO / "tests" / "_onecat_depth_probe.py").read_text()
    result = engine_source.import_check(engine_dir, "sm70", version, extra_code="\n" + probe)
    assert result["register"] == "ok", result["stderr"]
    line = [x for x in result["stdout"].splitlines() if x.startswith("QPN_DEPTH_1CAT ")]
    assert line, result["stderr"]
    out = json.loads(line[0][len("QPN_DEPTH_1CAT "):])
    names = {h.name for h in hooks_for(f"sm70@{version}", kind="runtime")}
    assert {"auto-depth-per-step", "auto-depth-acceptance", "auto-depth-verify-depth",
            "auto-depth-draft-depth", "auto-depth-drafter-loop"} <= names
    assert "auto-depth-drafter-loop" in out["chains"]["propose"]
    assert "auto-depth-per-step" in out["chains"]["update_after_schedule"]
    assert "auto-depth-verify-depth" in out["chains"]["update_from_output"]
    assert "auto-depth-acceptance" in out["chains"]["make_spec_decoding_stats"]

    # the drafter: d forwards (first pass + d - 1 loop steps), K columns, loop depth restored
    for call in out["drafts"]:
        d = call["depth"] or K
        assert call["forwards"] == list(range(d)), call
        assert call["shape"] == [3, K] and call["rows"] == _filled(d), call
        assert call["k_after"] == K and call["drafted"] == d, call

    # the scheduler: the request crossing the threshold changes depth, with no error; every step
    # verifies what the one before drafted; the async scheduler books K placeholders regardless
    steps = out["steps"]
    assert [s["depth"] for s in steps] == [7, 7, 3, 3], out["threshold"]
    assert [s["verify"]["r0"] for s in steps] == [7, 7, 7, 3]
    assert [s["placeholders"] for s in steps] == [K] * 4
    assert out["chosen"] == {"7": 2, "3": 2}
    # 7 rows verified, 3 drafted, 5 accepted (2 filler tokens by chance): 3 positions counted
    assert out["drafted"] == [1, 1, 1, 0, 0, 0, 0] and out["accepted"] == [1, 1, 1, 0, 0, 0, 0]
