"""CI's V100 readiness check: every QPN kernel compiled for sm_70 by NVRTC 12.9 + ptxas 12.9,
no spill, no local memory, HMMA.884 in every GEMM kernel, at most 64 registers per thread."""
from __future__ import annotations

import pytest

from qpn.kernels import jit, sm70_check


def test_sm70_kernels_are_v100_ready(capsys, sm70_toolchain):
    # the tools come from the conftest fixture (which fails under CI=true when they cannot be had),
    # so nothing here may skip or download
    res = sm70_check.run_check(download=False)
    with capsys.disabled():
        print("\n" + res.table())
    assert res.nvrtc_version[0] == 12
    names = [k.name for k in res.kernels]
    for entry in jit.ENTRY_POINTS["m8n8k4"] + jit.UNSERVED_ENTRY_POINTS["m8n8k4"]:   # INT4's too
        assert entry in names
    # the staged INT8 family's kernels are checked like the served ones (both members, both tilings)
    from qpn.kernels import formats
    int8 = [e for f in (formats.INT8, formats.INT8_SYM) for e in f.dense_entry_points("m8n8k4")]
    assert len(int8) == 6 and set(int8) <= set(names)
    for k in res.kernels:
        assert not k.problems, f"{k.name}: {k.problems}"
        assert k.spill_stores == 0 and k.spill_loads == 0 and k.stack_frame == 0
        assert k.cubin_local == 0 and k.local_insts == 0
        assert 0 < k.registers <= sm70_check.MAX_REGISTERS
        if k.is_gemm:
            assert k.hmma884 > 0, k.name


@pytest.mark.fast
def test_parsers_flag_violations():
    """The check fails when the tools report what it forbids (so a pass above means something)."""
    text = ("ptxas info    : Compiling entry function 'qpn9_bad' for 'sm_70'\n"
            "    16 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads\n"
            "ptxas info    : Used 72 registers, used 1 barriers\n")
    rep = sm70_check.parse_ptxas(text)["qpn9_bad"]
    assert (rep.registers, rep.spill_stores, rep.stack_frame) == (72, 8, 16)
    sm70_check.parse_sass("Function : qpn9_bad\n  LDL R1, [R2] ;\n", {"qpn9_bad": rep})
    assert rep.local_insts == 1 and rep.hmma884 == 0
