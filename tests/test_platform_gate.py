"""Where the QPN path serves: CPU (reference), SM70 (kernels), sm_80+ only when opted in."""
from __future__ import annotations

from collections import namedtuple

import pytest

Capability = namedtuple("Capability", "major minor")


class _CudaPlatform:
    def __init__(self, major: int, minor: int):
        self.cap = Capability(major, minor)

    def is_cpu(self):
        return False

    def is_cuda(self):
        return True

    def get_device_capability(self):
        return self.cap


@pytest.fixture
def gate(monkeypatch, nvrtc12):
    """serving_target() on a pretended CUDA device; kernels_ready() builds with NVRTC (conftest fixture)."""
    import vllm.platforms

    from qpn.fork_patches.engine import platform_gate

    def on(major, minor):
        monkeypatch.setattr(vllm.platforms, "current_platform", _CudaPlatform(major, minor))
        platform_gate.serving_target.cache_clear()
        return platform_gate.serving_target()

    yield on
    platform_gate.serving_target.cache_clear()


@pytest.mark.fast
def test_cpu_platform_serves_the_reference():
    from qpn.fork_patches.engine import platform_gate

    platform_gate.serving_target.cache_clear()
    assert platform_gate.serving_target() == {"backend": "reference", "arch": "sm70", "atom": "m8n8k4"}


def test_sm90_is_left_to_vllm_unless_opted_in(gate, monkeypatch):
    monkeypatch.delenv("QPN_SM80_OPT_IN", raising=False)
    assert gate(9, 0) is None
    monkeypatch.setenv("QPN_SM80_OPT_IN", "1")
    assert gate(9, 0) == {"backend": "cuda", "arch": "sm90", "atom": "m16n8k16"}


def test_sm70_is_served_and_sm75_never(gate, monkeypatch):
    monkeypatch.setenv("QPN_SM80_OPT_IN", "1")
    assert gate(7, 0) == {"backend": "cuda", "arch": "sm70", "atom": "m8n8k4"}
    assert gate(7, 5) is None
