"""Per-group proof on the CPU: every code position and every (row, group) scale of a weight is
checked exactly (tests/_per_group.py: one-hot activations, so each output is one weight value)
through the CPU reference (float32 and float64 levels, both atoms' buffers), the m8n8k4 lane
replay (every packed route) and the m16n8k16 lane replay; and each probe must name exactly the
(row, group) whose packed scale byte was corrupted, or the row whose FP8 channel scale was.
The GPU variant is test_gpu_kernels.py::test_every_position_and_group_scale_exact_on_gpu."""
from __future__ import annotations

import pytest
import torch

import _per_group as pg
import _sm70_replay as rp
from qpn.kernels.families.nvfp4 import layout as nvfp4_layout
from qpn.kernels.families.fp8 import layout as fp8_layout
from qpn.kernels import families

N, K = 40, 96           # partial tiles and k-blocks of both atoms; 6 groups, 3 / 2 k-blocks


@pytest.fixture(scope="module")
def replay():
    return rp.Replay()


def _weights(fmt, per_channel=True, seed=3):
    gen = torch.Generator().manual_seed(seed)
    wt = pg.nvfp4_probe_weight(N, K, gen) if fmt == "nvfp4" else pg.fp8_probe_weight(N, K, gen, per_channel)
    return wt, pg.exact_weight(fmt, wt)


def _pack(fmt, wt, atom):
    return nvfp4_layout.prepack(*wt, atom=atom) if fmt == "nvfp4" else fp8_layout.prepack(*wt, atom=atom)


def _runners(replay, packed, with_mt1=True):
    """name -> (run(x) -> y, tokens per call, positions (None: every input))."""
    p = "qpn2" if packed.fmt == "nvfp4" else "qpn8"
    out = {"reference_f64": (lambda x: families.reference_linear_f64(x, packed), K, None),
           "reference_f32": (lambda x: families.reference_linear(x, packed), K, None)}
    if packed.atom == "m8n8k4":
        out[f"replay_{p}_chunked"] = (lambda x: replay.linear(packed, x, p + "_chunked", ksplit=1), 64, None)
        out[f"replay_{p}_reconstruct"] = (lambda x: replay.linear(packed, x, p + "_reconstruct"), K, None)
        if with_mt1:   # the same decode as the chunked route, 8 tokens a call: every third input
            out[f"replay_{p}"] = (lambda x: replay.linear(packed, x, p, ksplit=2), 8, range(0, K, 3))
    else:
        from test_kernels_sm80 import _replay as replay16
        out["replay_m16n8k16"] = (lambda x: replay16(packed, x, True), 8, None)
    return out


ATOMS = ["m8n8k4", "m16n8k16"]


# m16n8k16's lane replay takes 8 tokens a call (12 calls here): its full probe is in the full tier;
# the fast tier keeps m8n8k4's, the corrupted-scale tests of both atoms and test_kernels_sm80's replay.
@pytest.mark.parametrize("atom", [pytest.param("m8n8k4", marks=pytest.mark.fast), "m16n8k16"])
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_every_position_and_group_scale_is_exact(replay, fmt, atom):
    wt, w64 = _weights(fmt)
    packed = _pack(fmt, wt, atom)
    for name, (run, per_call, positions) in _runners(replay, packed).items():
        bad = pg.probe(run, w64, per_call, positions)
        assert not bad, f"{atom} {fmt} {name}: wrong at (row, input) {bad[:8]} ({len(bad)} in all)"


@pytest.mark.fast
@pytest.mark.parametrize("atom", ATOMS)
def test_one_corrupted_group_scale_is_found_and_named(replay, atom):
    """One packed scale byte changed by one exponent step: the float64 reference names one
    (row, group) (none when the byte is tile padding, rows past N, read by nobody), and every other
    path names the same one: probed on that group's 16 inputs and on the next group's (which
    must stay exact)."""
    wt, w64 = _weights("nvfp4", seed=8)
    gen = torch.Generator().manual_seed(11 if atom == "m8n8k4" else 12)
    named = 0
    for _ in range(3):
        packed = _pack("nvfp4", wt, atom)
        i = int(torch.randint(0, packed.scales.numel(), (1,), generator=gen))
        packed.scales[i] ^= 0x08
        ref = pg.groups_of(pg.probe(lambda x: families.reference_linear_f64(x, packed), w64, K))
        assert len(ref) <= 1, f"{atom}: one corrupted byte changed several groups {sorted(ref)[:6]}"
        if not ref:
            continue
        named += 1
        (row, grp), = ref
        around = list(range(16 * grp, 16 * grp + 16)) + [(16 * grp + 16 + j) % K for j in range(16)]
        for name, (run, per_call, _) in _runners(replay, packed, with_mt1=False).items():
            groups = pg.groups_of(pg.probe(run, w64, per_call, around))
            assert groups == ref, f"{atom} {name} names {sorted(groups)}, the float64 reference {sorted(ref)}"
    assert named >= 1, "no trial hit a scale byte that a real row reads: the probe saw nothing"


@pytest.mark.fast
@pytest.mark.parametrize("atom", ATOMS)
def test_a_wrong_fp8_channel_scale_is_found_and_named(replay, atom):
    wt, w64 = _weights("fp8", per_channel=True, seed=4)
    packed = _pack("fp8", wt, atom)
    packed.scale[17] *= 2.0
    for name, (run, per_call, _) in _runners(replay, packed, with_mt1=False).items():
        bad = pg.probe(run, w64, per_call, positions=range(0, K, 5))
        assert bad and {r for r, _ in bad} == {17}, f"{atom} {name}: expected row 17 only, got {sorted({r for r, _ in bad})}"
