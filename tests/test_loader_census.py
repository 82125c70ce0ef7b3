"""Route census: per-rank files in the census schema (census_schema.py), written atomically, merged by
aggregate()."""
from __future__ import annotations

import json
import os
import time

import pytest

from qpn.fork_patches.route_census import census as census_mod
from qpn.fork_patches.route_census.census import Census, aggregate, read_rank_files, write_json_atomic
from qpn.fork_patches.route_census.census_schema import (
    SCHEMA_VERSION, SUMMARY_VERSION, CensusSchemaError, CensusSummary, RankSummary, validate_rank,
)
from qpn.kernels import routes as route_table


# The one-minute tier (pytest -m fast): nothing here boots an engine, builds a venv or downloads.
pytestmark = pytest.mark.fast

_PLATFORM = {"engine_version": "test", "platform": "cpu", "device_capability": None, "backend": "reference"}


def _rank_file(rank, modules, fallbacks=(), lm_head=None, kv=None):
    return {
        "schema": SCHEMA_VERSION, "rank": rank, "pid": 100 + rank, "engine_version": "0.32.0", "platform": "cuda",
        "device_capability": "7.0", "backend": "cuda",
        "kv_cache": kv or {"checkpoint_requested": "fp8_e4m3", "resolved": "float16", "policy": "sm70"},
        "modules": modules, "lm_head": lm_head, "fallbacks": list(fallbacks), "updated": "2026-11-29T00:00:00Z",
    }


_BANDS = {"qpn2": (1, 8), "qpn2_mt2": (9, 16), "qpn8": (1, 8), "qpn8_mt2": (9, 16)}


def _mod(region, routes, eligible=True, verified=True):
    def band(r):
        lo, hi = _BANDS.get(r, (None, None))
        return {"m_min": lo, "m_max": hi}
    return {"region": region, "eligible": eligible, "n": 64, "k": 128, "prepack_verified": verified,
            "routes": {r: {"eager": e, "graph": g, **band(r)} for r, (e, g) in routes.items()}}


def test_aggregate_merges_ranks_and_finds_what_is_off_qpn(tmp_path):
    head = {"module": "lm_head", "region": "nvfp4", "source": "checkpoint_codes", "route_family": "qpn2",
            "repack_fallback": False}
    write_json_atomic(str(tmp_path / "census_rank0.json"), _rank_file(0, {
        "a.qkv_proj": _mod("fp8", {"qpn8": (10, 2), "qpn8_mt2": (3, 1)}),
        "a.gate_up_proj": _mod("nvfp4", {"qpn2": (7, 0)}),
        "lm_head": _mod("nvfp4", {"qpn2": (5, 1)}),
    }, lm_head=head))
    write_json_atomic(str(tmp_path / "census_rank1.json"), _rank_file(1, {
        "a.qkv_proj": _mod("fp8", {"qpn8": (4, 0)}),
        "a.gate_up_proj": _mod("nvfp4", {"marlin": (2, 0)}),          # not a QPN route
        "a.down_proj": _mod("nvfp4", {"qpn2": (1, 0)}, verified=False),  # prepack not proven
        "a.o_proj": _mod("fp8", {"qpn8": (1, 0)}),
    }, fallbacks=[{"module": "a.o_proj", "reason": "shape", "count": 3}], lm_head=head))
    # Files that are not rank files are ignored; a temp file of a writer in progress too.
    (tmp_path / ".census-x.tmp").write_text("{")
    (tmp_path / "notes.json").write_text("{}")

    agg = aggregate(str(tmp_path))
    assert [r["rank"] for r in agg["ranks"]] == [0, 1]
    assert agg["modules_total"] == 7
    assert agg["modules_by_region"] == {"fp8": 3, "nvfp4": 4}
    # on QPN: r0 all 3; r1 only qkv_proj (gate_up on marlin, down unverified, o_proj fell back)
    assert agg["modules_on_qpn"] == 4
    assert agg["route_counts"]["qpn8"] == {"eager": 15, "graph": 2, "m_min": 1, "m_max": 8}
    assert agg["route_counts"]["qpn2"] == {"eager": 13, "graph": 1, "m_min": 1, "m_max": 8}
    assert agg["route_counts"]["marlin"] == {"eager": 2, "graph": 0, "m_min": None, "m_max": None}
    assert agg["non_qpn_routes"] == ["marlin"]
    assert agg["fallback_calls"] == 3
    assert agg["fallbacks"] == [{"module": "a.o_proj", "reason": "shape", "count": 3, "rank": 1}]
    assert agg["lm_head"] == [head, head]
    assert [k["resolved"] for k in agg["kv_resolved"]] == ["float16", "float16"]
    # what the gates read: the same summary, typed and versioned (census_schema.CensusSummary)
    summary = CensusSummary.from_dict(agg)
    assert agg["summary_version"] == SUMMARY_VERSION
    assert [(type(r), r.rank, r.modules_on_qpn) for r in summary.ranks] == [(RankSummary, 0, 3),
                                                                            (RankSummary, 1, 1)]
    assert summary.modules_on_qpn == 4 and CensusSummary.from_dict(summary) is summary


def test_aggregate_of_an_empty_folder_is_empty_not_an_error(tmp_path):
    agg = aggregate(str(tmp_path))
    assert agg["modules_total"] == 0 and agg["ranks"] == [] and agg["fallback_calls"] == 0


def test_reader_refuses_another_schema(tmp_path):
    for other in (SCHEMA_VERSION - 1, SCHEMA_VERSION + 1):
        data = _rank_file(0, {})
        data["schema"] = other
        (tmp_path / "census_rank0.json").write_text(json.dumps(data))
        with pytest.raises(ValueError, match=f"census schema {other}, this reader knows {SCHEMA_VERSION}"):
            read_rank_files(str(tmp_path))


def test_census_records_and_flushes_in_the_schema(tmp_path, monkeypatch):
    monkeypatch.setenv("QPN_CENSUS_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    # the rank comes from RANK when no process group exists (another test file may have left one)
    import torch.distributed

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    c = Census()
    c.platform = _PLATFORM  # skip importing the engine; the e2e test checks the detection
    layer_a, layer_b = object(), object()
    name = c.register_module(layer_a, "model.layers.0.mlp.gate_up_proj", "nvfp4", 512, 128, prepack_verified=True)
    # A second layer with the same prefix (an MTP drafter's own head) gets its own entry.
    assert c.register_module(layer_b, "model.layers.0.mlp.gate_up_proj", "nvfp4", 512, 128) == name + "#2"
    c.count(name, route_table.route_for("nvfp4", 3, 512, 128))  # a Route value, as the loader counts
    c.count(name, "qpn2")                                         # or its name
    c.count(name, route_table.as_route("qpn2_mt2"), graph=True)
    c.fallback(name + "#2", "test reason")
    c.set_lm_head("lm_head", "nvfp4", "checkpoint_codes", "qpn2")
    c.set_lm_head("lm_head#2", "nvfp4", "checkpoint_codes", "qpn2")  # the first head stays
    c.set_kv_cache("fp8_e4m3", "bfloat16", "why")
    path = c.flush()
    assert os.path.basename(path) == "census_rank3.json"
    data = json.loads(open(path).read())
    assert data["schema"] == SCHEMA_VERSION and data["rank"] == 3 and data["pid"] == os.getpid()
    assert data["modules"][name]["routes"] == {"qpn2": {"eager": 2, "graph": 0, "m_min": 1, "m_max": 8},
                                               "qpn2_mt2": {"eager": 0, "graph": 1, "m_min": 9, "m_max": 16}}
    assert data["modules"][name]["prepack_verified"] is True
    assert data["fallbacks"] == [{"module": name + "#2", "reason": "test reason", "count": 1}]
    assert data["lm_head"]["module"] == "lm_head"
    assert data["kv_cache"] == {"checkpoint_requested": "fp8_e4m3", "resolved": "bfloat16", "policy": "why"}
    for key in ("engine_version", "platform", "device_capability", "backend", "updated"):
        assert key in data
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_background_flush_follows_new_counts_within_a_second_or_two(tmp_path, monkeypatch):
    monkeypatch.setenv("QPN_CENSUS_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(census_mod, "FLUSH_INTERVAL_S", 0.2)
    c = Census()
    c.platform = _PLATFORM
    name = c.register_module(object(), "m", "fp8", 8, 16, prepack_verified=True)
    c.count(name, "qpn8", calls=5)
    path = tmp_path / "census_rank0.json"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if path.exists() and json.loads(path.read_text())["modules"]["m"]["routes"].get("qpn8", {}).get("eager") == 5:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the census thread did not write the new counts")
    c._stop.set()


def test_every_table_route_is_recorded_with_its_m_band(tmp_path, monkeypatch):
    """The census records each route under its name with the M band route_for gives it: the band
    read back from the file selects exactly that route for every M in it, and no other M does."""
    monkeypatch.setenv("QPN_CENSUS_DIR", str(tmp_path))
    c = Census()
    c.platform, c.rank = _PLATFORM, 0
    layers = {fmt: object() for fmt in route_table.FORMATS}  # alive: the census keys layers by id()
    for fmt in route_table.FORMATS:
        name = c.register_module(layers[fmt], f"m.{fmt}", fmt, 64, 128, prepack_verified=True)
        for m in range(1, 200):
            c.count(name, route_table.route_for(fmt, m, 64, 128))
        if fmt in route_table.formats.MOE_FAMILIES:   # INT4 has no MoE route
            c.count(name, route_table.moe_route_for(fmt))
        c.count(name, "marlin")
    data = json.loads(open(c.flush()).read())
    for fmt in route_table.FORMATS:
        recorded = data["modules"][f"m.{fmt}"]["routes"]
        assert set(recorded) == {str(r) for r in route_table.ALL_ROUTES.values() if r.format == fmt} | {"marlin"}
        assert recorded["marlin"] == {"eager": 1, "graph": 0, "m_min": None, "m_max": None}
        for route, slot in recorded.items():
            if route == "marlin" or route.endswith("_moe"):
                continue
            lo, hi = slot["m_min"], slot["m_max"]
            chosen = {m for m in range(1, 200) if str(route_table.route_for(fmt, m, 64, 128)) == route}
            assert chosen == set(range(lo, (hi or 199) + 1)), route
            assert slot["eager"] == len(chosen)
        if fmt in route_table.formats.MOE_FAMILIES:
            assert recorded[f"{route_table.ROUTE_PREFIX[fmt]}_moe"] == {"eager": 1, "graph": 0, "m_min": 1, "m_max": None}


def test_schema_requires_the_band_of_every_module_route():
    data = _rank_file(0, {"a": _mod("fp8", {"qpn8": (1, 0)})})
    validate_rank(data)
    del data["modules"]["a"]["routes"]["qpn8"]["m_max"]
    with pytest.raises(CensusSchemaError, match="missing key 'm_max'"):
        validate_rank(data)
