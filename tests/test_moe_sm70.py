"""V100 readiness of the grouped MoE kernels (csrc/qpn_moe.cu): compiled for sm_70 by NVRTC 12.9
+ ptxas 12.9 (sm70_check.moe_check); no spill, no local memory, HMMA.884 in every expert GEMM,
at most 64 registers per thread. The routing (align) and combine kernels issue no MMA."""
from __future__ import annotations

from qpn.kernels import moe, sm70_check


def test_moe_kernels_are_v100_ready(capsys, sm70_toolchain):
    # tools from the conftest fixture (fails under CI=true when they cannot be had): no skip here
    res = sm70_check.moe_check(download=False)
    with capsys.disabled():
        print("\n" + res.table())
    assert res.nvrtc_version[0] == 12
    names = [k.name for k in res.kernels]
    assert names[: len(moe.entry_points())] == list(moe.entry_points())
    gemms = [k for k in res.kernels if k.is_gemm]
    assert sorted(k.name for k in gemms) == sorted(n for n in moe.entry_points() if "_moe_" in n and
                                                    ("gate_up" in n or "down" in n))
    for k in res.kernels:
        assert not k.problems, f"{k.name}: {k.problems}"
        assert k.spill_stores == 0 and k.spill_loads == 0 and k.stack_frame == 0
        assert k.cubin_local == 0 and k.local_insts == 0
        assert 0 < k.registers <= sm70_check.MAX_REGISTERS
    for k in gemms:
        assert k.hmma884 > 0, k.name
    assert not any(k.hmma884 for k in res.kernels if not k.is_gemm)
