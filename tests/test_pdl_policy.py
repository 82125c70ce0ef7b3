"""Which launches use programmatic dependent launch (kernels/sm80_plan.py ``pdl_form``), decided on the CPU.

A *_pdl kernel reads the weight before it waits for the stream's previous kernel, and only some
route kernels were measured faster with it on the H200 (sm80_tables.SM80_PDL_KERNELS: every mt1 kernel
and the FP8 mt2 ring). The policy must give the *_pdl form exactly to those on sm_90+ with a driver
that has cuLaunchKernelEx, never to an sm_80-89 GPU, the NVFP4 mt2 ring or a measured variant,
and never when QPN_PDL=0. The numerics of the PDL launches themselves run on the H200
(tests/test_gpu_eager_launch.py).
"""
from __future__ import annotations

import types

import pytest

from qpn.kernels import jit, ops, sm80_plan, sm80_tables

pytestmark = pytest.mark.fast

ROUTE_KERNELS = sorted(set(sm80_tables.SM80_ROUTE_KERNELS.values()) | set(sm80_tables.SM80_LARGE_N_KERNELS.values()))


@pytest.fixture
def gpu(monkeypatch):
    """A fake cuda:0 of a chosen capability and a driver with or without cuLaunchKernelEx."""
    state = {"cap": (9, 0), "ex": True}
    monkeypatch.setattr(ops.torch.cuda, "get_device_capability", lambda idx=None: state["cap"])
    monkeypatch.setattr(jit, "driver", lambda: types.SimpleNamespace(has_launch_ex=state["ex"]))
    monkeypatch.setattr(sm80_plan, "pdl_capable", {})
    monkeypatch.setattr(sm80_plan, "pdl_names", {})
    monkeypatch.delenv(sm80_plan.PDL_ENV, raising=False)
    return state


def test_the_pdl_route_kernels_get_their_pdl_form_on_sm90(gpu):
    kernels = sm80_plan.sm80_kernels()
    # The measured rule (results/kernel_sm80_pdl_notes_h200_20261201.md), stated from the kernels'
    # own configurations, not from the table under test: every one-tile route kernel (NVFP4, FP8,
    # INT4: results/kernel_matched_int4_pdl_h200_20261204.csv, qpn against qpn_plain) and the FP8 two-tile
    # kernel were faster with PDL; the NVFP4 two-tile ring was not, and INT4's two-tile kernels and
    # every INT8 kernel were not timed with it: plain launches, no *_pdl form.
    measured = {k for k in ROUTE_KERNELS if not kernels[k].frag.startswith("Frag16INT8")
                and (kernels[k].mt == 1 or kernels[k].frag == "Frag16FP8")}
    assert {kernels[k].mt for k in measured} == {1, 2} and len(measured) == 6
    assert sm80_tables.SM80_PDL_KERNELS == measured
    untimed = sorted(k for k in set(ROUTE_KERNELS) - measured if kernels[k].frag.startswith(("Frag16INT4", "Frag16INT8")))
    assert untimed and all(kernels[k].mt == 2 for k in untimed if kernels[k].frag.startswith("Frag16INT4"))
    assert sum(kernels[k].frag.startswith("Frag16INT8") for k in untimed) == 4
    assert all(k + "_pdl" not in kernels and sm80_plan.pdl_form(k, 0) is None for k in untimed)
    for name in sm80_tables.SM80_PDL_KERNELS:
        form = sm80_plan.pdl_form(name, 0)
        assert form == name + "_pdl", name
        cfg, base = kernels[form], kernels[name]
        # the same kernel, hooks added: same format, tiling, ring, token tiles and partition unit
        # (a per-warp *_pdl form of a block-cooperative kernel would get the wrong grid)
        assert (cfg.frag, cfg.mt, cfg.tiles, cfg.depth, cfg.stages, cfg.x_global, cfg.coop, cfg.min_blocks,
                cfg.variant) == (base.frag, base.mt, base.tiles, base.depth, base.stages, base.x_global, base.coop,
                                 base.min_blocks, 7), name


def test_other_kernels_and_older_gpus_keep_plain_launches(gpu):
    kernels = sm80_plan.sm80_kernels()
    nvfp4_mt2 = sm80_tables.SM80_ROUTE_KERNELS[(ops.formats.FAMILIES["nvfp4"], 2)]
    assert nvfp4_mt2 + "_pdl" in kernels and sm80_plan.pdl_form(nvfp4_mt2, 0) is None   # slower on small layers
    variants = [k for k, c in kernels.items() if c.variant not in (0, 7)]
    assert variants and all(sm80_plan.pdl_form(k, 0) is None for k in variants)
    chosen = sorted(sm80_tables.SM80_PDL_KERNELS)
    for cap in ((8, 0), (8, 6), (8, 9)):
        gpu["cap"] = cap
        sm80_plan.pdl_capable.clear()
        assert all(sm80_plan.pdl_form(k, 0) is None for k in chosen), cap
    gpu["cap"], gpu["ex"] = (9, 0), False
    sm80_plan.pdl_capable.clear()
    assert all(sm80_plan.pdl_form(k, 0) is None for k in chosen), "a driver without cuLaunchKernelEx"


@pytest.mark.parametrize("value,on", [("0", False), ("off", False), ("1", True), ("", True), ("yes", True)])
def test_qpn_pdl_switch(gpu, monkeypatch, value, on):
    monkeypatch.setenv(sm80_plan.PDL_ENV, value)
    name = sm80_tables.SM80_ROUTE_KERNELS[(ops.formats.FAMILIES["nvfp4"], 1)]
    assert (sm80_plan.pdl_form(name, 0) is not None) is on


def test_a_bad_qpn_pdl_value_names_the_setting(gpu, monkeypatch):
    monkeypatch.setenv(sm80_plan.PDL_ENV, "maybe")
    with pytest.raises(ValueError, match="QPN_PDL='maybe'"):
        sm80_plan.pdl_form(sm80_tables.SM80_ROUTE_KERNELS[(ops.formats.FAMILIES["fp8"], 1)], 0)


def test_the_kernel_source_is_parsed_once_per_kernel_not_per_call(gpu, monkeypatch):
    """The general launch path (the custom op torch.compile calls) asks pdl_form on every call:
    parsing the sm_80+ source there took the call's host time from about 45 us to 600-800 us
    on the H200 (results/kernel_sm80_pdlfp8_targets_h200_20261201.md, qpn_general_path)."""
    parses = []
    real = sm80_plan.sm80_kernels
    monkeypatch.setattr(sm80_plan, "sm80_kernels", lambda: parses.append(1) or real())
    names = sorted(sm80_tables.SM80_PDL_KERNELS) + [sm80_tables.SM80_ROUTE_KERNELS[(ops.formats.FAMILIES["nvfp4"], 2)]]
    first = [sm80_plan.pdl_form(k, 0) for k in names]
    for _ in range(50):
        assert [sm80_plan.pdl_form(k, 0) for k in names] == first
    assert len(parses) == len(names)
