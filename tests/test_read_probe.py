"""benchmarks/read_probe.py: its kernels build for sm_80 and sm_90 and export what the matched bench's
read_limit arm launches (no GPU needed; the timings themselves are GPU-only: results/read_probe_*)."""
import pytest

from qpn.benchmarks import read_probe
from qpn.kernels import jit


@pytest.mark.parametrize("arch", [80, 90])
def test_probe_kernels_build_and_export_every_configured_kernel(arch, nvrtc12):
    res = nvrtc12.compile(read_probe.SOURCE, "read_probe.cu", arch, list(jit.COMPILE_FLAGS), want_cubin=True)
    names = {k for k, _ in read_probe.LIMIT_CONFIGS} | {k for ks in read_probe.KERNELS.values() for k, _ in ks}
    names |= {k for k, _ in read_probe.QPN_PATTERN} | {k for k, _, _ in read_probe.BULK}
    for name in names:
        assert name.encode() + b"\0" in res.cubin, name


def test_shape_bytes_are_whole_chunks_of_the_packed_layer():
    nvfp4 = 34816 * 5120 // 2 + 34816 * 5120 // 16           # codes + one e4m3 scale per 16 weights
    assert read_probe.shape_bytes("nvfp4", 34816, 5120) == -(-nvfp4 // 8192) * 8192
    assert read_probe.shape_bytes("fp8", 5120, 6144) == 5120 * 6144   # already whole 8 KB chunks
    assert read_probe.shape_bytes("fp8", 16, 64) == 8192
