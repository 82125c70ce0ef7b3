"""Census schema and the gates that read it (issue 11 item 7): the writer and the gates share
``census_schema``; qpn_routes checks the checkpoint's own quantized_layers on every rank;
census_platform wants one census per tensor-parallel rank; lm_head_from_codes reports what the
loader did; served_depth wants draft tokens proposed, not only positions exported."""
from __future__ import annotations

import json
import types

import pytest
import torch

from qpn.fork_patches.route_census import census as census_mod
from qpn.fork_patches.route_census.census import Census, aggregate, attention_layer_groups
from qpn.fork_patches.route_census.census_schema import (
    SCHEMA_VERSION, SUMMARY_VERSION, CensusSchemaError, CensusSummary, validate_rank,
)
from qpn.scripts.launcher import boot_gates
from qpn.scripts.launcher.engine_profiles import CPU

_PLATFORM = {"engine_version": "0.32.0", "platform": "cpu", "device_capability": None,
             "backend": "reference"}
LAYERS = {  # a checkpoint's quantized_layers: fused q/k/v shards, an MLP, the head, the drafter
    "model.language_model.layers.0.self_attn.q_proj": {"quant_algo": "FP8"},
    "model.language_model.layers.0.self_attn.k_proj": {"quant_algo": "FP8"},
    "model.language_model.layers.0.self_attn.v_proj": {"quant_algo": "FP8"},
    "model.language_model.layers.0.mlp.down_proj": {"quant_algo": "NVFP4", "group_size": 16},
    "lm_head": {"quant_algo": "NVFP4", "group_size": 16},
    "mtp.layers.0.mlp.down_proj": {"quant_algo": "NVFP4", "group_size": 16},
}
QKV = [k for k in LAYERS if "self_attn" in k]


def _same(name):
    return name


def _hub_to_vllm(name):  # what Qwen3.5's hf_to_vllm_mapper does to these names
    return name.replace("model.language_model.", "model.")


def _write_rank(tmp_path, rank, tp=2, k=3, skip=(), off_qpn=(), head=True, rename=_same, lost=None,
                depth_steps=None, claimed="qpn"):
    c = Census()
    c.platform = _PLATFORM
    c.rank = rank
    c.directory = str(tmp_path)
    c._engine_config = types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(tensor_parallel_size=tp),
        model_config=types.SimpleNamespace(max_model_len=1024, enforce_eager=True),
        speculative_config=types.SimpleNamespace(num_speculative_tokens=k) if k else None,
        compilation_config=types.SimpleNamespace(static_forward_context={}),
    )
    modules = [("model.layers.0.self_attn.qkv_proj", "fp8", QKV),
               ("model.layers.0.mlp.down_proj", "nvfp4", ["model.language_model.layers.0.mlp.down_proj"]),
               ("lm_head", "nvfp4", ["lm_head"]),
               ("mtp.layers.0.mlp.down_proj", "nvfp4", ["mtp.layers.0.mlp.down_proj"])]
    layers = [object() for _ in modules]  # alive: the census knows layers by id()
    for layer, (name, region, declared) in zip(layers, modules):
        if name in skip:
            continue
        n = c.register_module(layer, name, region, 64, 128, prepack_verified=True,
                              declared=[rename(d) for d in declared])
        c.count(n, "marlin" if name in off_qpn else ("qpn8" if region == "fp8" else "qpn2"))
    c.set_quantized_layers([rename(n) for n in LAYERS] if lost is None else
                           [rename(n) for n in LAYERS if n != lost])
    if head:
        c.set_lm_head("lm_head", "nvfp4", "checkpoint_codes", "qpn2")
    c.set_kv_cache("fp8_e4m3", "fp8_e4m3", "engine")
    if claimed:
        c.set_quant_config(claimed)
    for depth, steps in (depth_steps or {}).items():
        c.count_draft_depth(depth, steps)
    c._stop.set()
    return c.flush()


def test_written_file_follows_the_schema_and_bad_fields_are_named(tmp_path):
    data = json.loads(open(_write_rank(tmp_path, 0)).read())
    assert data["schema"] == SCHEMA_VERSION and data["tensor_parallel_size"] == 2
    assert data["quant_config"] == "qpn"
    assert data["serving"]["num_speculative_tokens"] == 3
    assert data["modules"]["model.layers.0.self_attn.qkv_proj"]["declared"] == sorted(QKV)
    validate_rank(data)
    bad = json.loads(json.dumps(data))
    bad["modules"]["lm_head"]["n"] = "64"
    with pytest.raises(CensusSchemaError, match=r"modules\['lm_head'\]\.n"):
        validate_rank(bad)
    bad = json.loads(json.dumps(data))
    bad["attention_routes"] = {"decode_xqa_paged": 3}  # counts must be {eager, graph}
    with pytest.raises(CensusSchemaError, match="attention_routes"):
        validate_rank(bad)
    bad = json.loads(json.dumps(data))
    bad["surprise"] = 1
    with pytest.raises(CensusSchemaError, match="unknown key"):
        validate_rank(bad)


def test_attention_layer_groups_read_what_the_layers_use():
    def layer(kv, cache_dtype, heads=6, window=None):
        impl = types.SimpleNamespace(kv_cache_dtype=kv)
        cache = torch.zeros(2, 2, dtype=cache_dtype) if cache_dtype is not None else torch.tensor([])
        return types.SimpleNamespace(impl=impl, head_size=256, num_heads=heads, num_kv_heads=1,
                                     sliding_window=window, kv_cache=cache)

    ctx = {"model.layers.3.self_attn.attn": layer("auto", torch.float16),
           "model.layers.7.self_attn.attn": layer("auto", torch.float16),
           "mtp.layers.0.self_attn.attn": layer("float16", torch.float16),
           "model.layers.0.linear_attn": types.SimpleNamespace(kv_cache=[torch.zeros(1)]),  # GDN
           "x.attn": layer("fp8_e5m2", torch.uint8, window=(127, 0)),
           "y.attn": layer("auto", None)}  # cache not bound yet
    groups = {g["names"][0]: g for g in attention_layer_groups(ctx)}
    assert groups["model.layers.3.self_attn.attn"]["layers"] == 2
    assert groups["model.layers.3.self_attn.attn"]["cache_tensor_dtype"] == "float16"
    assert groups["mtp.layers.0.self_attn.attn"]["kv_cache_dtype"] == "float16"
    assert groups["x.attn"]["cache_tensor_dtype"] == "uint8" and groups["x.attn"]["sliding_window"] == 128
    assert groups["y.attn"]["cache_tensor_dtype"] is None
    assert sum(g["layers"] for g in groups.values()) == 5


def _gates(tmp_path, tp=2, k=3, metrics_k=None, qpn_claim="modelopt_mixed"):
    agg = aggregate(str(tmp_path))
    metrics = _metrics(metrics_k if metrics_k is not None else k, drafted=True)
    return {r.name: r for r in boot_gates.evaluate(CPU, k, {"ok": True, "completion_tokens": 4}, metrics,
                                                   agg, {"nvfp4", "fp8"}, tp=tp,
                                                   quantized_layers=LAYERS, qpn_claim=qpn_claim)}


def test_quant_config_gate_wants_the_qpn_config_on_every_rank_of_a_checkpoint_qpn_serves(tmp_path):
    _write_rank(tmp_path, 0)
    _write_rank(tmp_path, 1)
    agg = aggregate(str(tmp_path))
    assert agg["ranks"][1]["quant_config"] == "qpn"
    assert (SCHEMA_VERSION, agg["summary_version"]) == (6, 3)  # quant_config: schema 6, summary 3
    g = _gates(tmp_path)["quant_config"]
    assert g.status == "PASS" and g.observed == "rank 0: qpn; rank 1: qpn", g
    assert "modelopt_mixed" in g.expected
    _write_rank(tmp_path, 1, claimed=None)  # rank 1's census: no QPN config reached it
    g = _gates(tmp_path)["quant_config"]
    assert g.failed and "rank 1: no QPN config" in g.observed and "rank(s) [1] were not served" in g.observed, g


def test_quant_config_gate_fails_without_any_census_and_when_qpn_claims_what_it_should_not(tmp_path):
    g = boot_gates.gate_quant_config({"ranks": []}, "compressed-tensors")
    assert g.failed and "reached no rank" in g.observed, g
    _write_rank(tmp_path, 0, tp=1)
    wrong = _gates(tmp_path, tp=1, qpn_claim=None)["quant_config"]
    assert wrong.failed and "should not claim" in wrong.observed, wrong
    engine = boot_gates.gate_quant_config({"ranks": [{"rank": 0}]}, None, "QPN_INT4=0 leaves INT4 checkpoints "
                                          "to the engine's own kernels")
    assert engine.status == "PASS" and "QPN_INT4=0" in engine.expected and "rank 0: no QPN config" in engine.observed


def _metrics(k, drafted):
    lines = [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",position="{i}"}} 0.0'
             for i in range(k)]
    lines.append(f'vllm:spec_decode_num_draft_tokens_total{{engine="0"}} {12.0 if drafted else 0.0}')
    lines.append(f'vllm:spec_decode_num_drafts_total{{engine="0"}} {4.0 if drafted else 0.0}')
    return "\n".join(lines) + "\n"


def test_gates_pass_over_two_ranks(tmp_path):
    for rank in (0, 1):
        _write_rank(tmp_path, rank)
    gates = _gates(tmp_path)
    assert not any(g.failed for g in gates.values()), gates
    assert "ranks [0, 1]" in gates["census_platform"].observed
    assert "(6)" in gates["qpn_routes"].expected


def test_census_platform_wants_every_rank(tmp_path):
    _write_rank(tmp_path, 0)
    g = _gates(tmp_path)["census_platform"]
    assert g.failed and "no census from rank(s) [1] of TP=2" in g.observed
    _write_rank(tmp_path, 1, tp=4)
    g = _gates(tmp_path)["census_platform"]
    assert g.failed and "report TP" in g.observed


@pytest.mark.parametrize("change,needle", [
    (dict(skip=("mtp.layers.0.mlp.down_proj",)), "not in the census, e.g. ['mtp.layers.0.mlp.down_proj']"),
    (dict(skip=("model.layers.0.self_attn.qkv_proj",)), "3 of 6 checkpoint module(s)"),
    (dict(off_qpn=("model.layers.0.mlp.down_proj",)), "admitted but not on a QPN route"),
])
def test_qpn_routes_checks_every_listed_module_on_every_rank(tmp_path, change, needle):
    _write_rank(tmp_path, 0)
    _write_rank(tmp_path, 1, **change)
    g = _gates(tmp_path)["qpn_routes"]
    assert g.failed and "rank 1" in g.observed and needle in g.observed, g.observed


def test_engine_renamed_keys_pair_with_the_checkpoints_and_a_lost_key_fails(tmp_path):
    for rank in (0, 1):
        _write_rank(tmp_path, rank, rename=_hub_to_vllm)
    assert not _gates(tmp_path)["qpn_routes"].failed, _gates(tmp_path)["qpn_routes"].observed
    _write_rank(tmp_path, 1, rename=_hub_to_vllm, skip=("model.layers.0.mlp.down_proj",))
    g = _gates(tmp_path)["qpn_routes"]
    assert g.failed and "model.language_model.layers.0.mlp.down_proj (engine: model.layers.0.mlp.down_proj)" in g.observed
    _write_rank(tmp_path, 1, lost="lm_head")
    g = _gates(tmp_path)["qpn_routes"]
    assert g.failed and "the engine holds 5 quantized_layers names, the checkpoint lists 6" in g.observed


def test_drafter_modules_are_not_needed_without_speculation(tmp_path):
    for rank in (0, 1):
        _write_rank(tmp_path, rank, k=0, skip=("mtp.layers.0.mlp.down_proj",))
    gates = _gates(tmp_path, k=0)
    assert not gates["qpn_routes"].failed, gates["qpn_routes"].observed


def test_lm_head_missing_on_one_rank_fails(tmp_path):
    _write_rank(tmp_path, 0)
    _write_rank(tmp_path, 1, head=False)
    g = _gates(tmp_path)["lm_head_from_codes"]
    assert g.failed and "1 rank(s)" in g.observed


def test_steps_per_drafted_depth_are_written_summarised_and_gated(tmp_path):
    # K=auto: each rank counts the steps its drafter drafted at each depth (schema 5)
    data = json.loads(open(_write_rank(tmp_path, 0, depth_steps={3: 5, 1: 2})).read())
    assert data["schema"] == SCHEMA_VERSION >= 5  # draft_depth_steps: schema 5 on
    assert data["draft_depth_steps"] == {"1": 2, "3": 5}
    _write_rank(tmp_path, 1, depth_steps={3: 5, 1: 2})
    agg = aggregate(str(tmp_path))
    assert agg["summary_version"] == SUMMARY_VERSION >= 2
    assert agg["draft_depth_steps"] == {"1": 2, "3": 5}  # the ranks draft the same steps
    assert [r["draft_depth_steps"] for r in agg["ranks"]] == [{"1": 2, "3": 5}] * 2
    summary = CensusSummary.from_dict(agg)
    assert boot_gates.census_depth_steps(summary) == {1: 2, 3: 5}
    auto = boot_gates.AutoDepth((1, 3), short=(30, 3), long=(900, 1))
    gates = {r.name: r for r in boot_gates.evaluate(
        CPU, 3, {"ok": True, "completion_tokens": 4}, _metrics(3, drafted=True), agg,
        {"nvfp4", "fp8"}, tp=2, quantized_layers=LAYERS, auto_depth=auto)}
    assert not gates["served_depth"].failed, gates["served_depth"]
    assert "(census) 1: 2, 3: 5" in gates["served_depth"].observed
    # a fixed depth counts nothing; a count that is not a whole number is off schema
    assert json.loads(open(_write_rank(tmp_path / "fixed", 0)).read())["draft_depth_steps"] == {}
    bad = json.loads(json.dumps(data))
    bad["draft_depth_steps"] = {"3": "5"}
    with pytest.raises(CensusSchemaError, match="draft_depth_steps"):
        validate_rank(bad)
    with pytest.raises(CensusSchemaError, match="draft_depth_steps"):
        CensusSummary.from_dict({**agg, "draft_depth_steps": {"3": 1.5}})
    with pytest.raises(CensusSchemaError, match="summary version 1"):
        CensusSummary.from_dict({**agg, "summary_version": 1})


def test_served_depth_wants_drafts_proposed():
    assert not boot_gates.gate_depth(3, _metrics(3, drafted=True)).failed
    g = boot_gates.gate_depth(3, _metrics(3, drafted=False))
    assert g.failed and "speculation is configured but not running" in g.observed
    assert boot_gates.gate_depth(2, _metrics(3, drafted=True)).failed
    assert not boot_gates.gate_depth(0, _metrics(0, drafted=False)).failed


def test_lm_head_source_comes_from_the_loader():
    """weight_source reads what the checked loader received and what the prepack proved."""
    pytest.importorskip("vllm")
    from qpn.fork_patches.quant.linear_method import qpn_linear_method

    m = qpn_linear_method("lm_head", "NVFP4", {"backend": "reference"})
    m.partition_sizes, m.n = [64], 64
    assert m.weight_source() == "not_from_checkpoint"
    m.loaded = {"weight": {0}, "weight_scale": {0}, "weight_scale_2": {0}}
    assert m.weight_source() == "checkpoint_unverified"  # nothing packed and proven yet
    m.pieces = [(0, 64, object())]
    assert m.weight_source() == "checkpoint_codes"
    m.loaded["weight_scale"] = set()
    assert m.weight_source() == "not_from_checkpoint"


@pytest.fixture(autouse=True)
def _no_background_flush(monkeypatch):
    monkeypatch.setattr(census_mod, "FLUSH_INTERVAL_S", 3600)


def test_a_record_off_schema_is_not_written_and_is_reported(tmp_path, caplog):
    c = Census()
    c.platform = _PLATFORM
    c.rank, c.directory = 0, str(tmp_path)
    c.register_module(object(), "m", "fp8", 8, 16, prepack_verified=True)
    c.modules["m"]["n"] = "eight"  # a writer bug
    with caplog.at_level("ERROR", logger="vllm.qpn.census"):
        c._dirty = True
        c._flush_at_exit()
    assert not list(tmp_path.iterdir())
    assert "does not follow the census schema" in caplog.text and "modules['m'].n" in caplog.text


# ---- the modules a checkpoint declares, asked of its convention (issue 15 item 2) -------------
@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory):
    """The four generators' checkpoints of seed 0: ModelOpt and compressed-tensors, dense and MoE."""
    from qpn.scripts.checkpoints import make_checkpoint, make_ct_checkpoint, make_moe_checkpoint

    root = tmp_path_factory.mktemp("declared")
    make_checkpoint.make_checkpoint(root / "modelopt", seed=0)
    make_ct_checkpoint.make_ct_checkpoint(root / "ct", seed=0)
    make_moe_checkpoint.make_moe_checkpoint(root / "modelopt-moe", seed=0)
    make_ct_checkpoint.make_ct_checkpoint(root / "ct-moe", seed=0, moe=True)
    return root


def _formats(declared: dict) -> dict[str, str]:
    return {name: scheme.fmt for name, scheme in declared.items()}


@pytest.mark.parametrize("family", ["", "-moe"])
def test_both_conventions_declare_the_same_modules(tiny_checkpoints, family):
    """The same model quantized the same way declares the same modules in the same formats,
    whether ModelOpt lists them (quantized_layers) or compressed-tensors matches them
    (config_groups regex targets on the checkpoint's module names)."""
    mo_conv, mo = boot_gates.declared_modules(str(tiny_checkpoints / f"modelopt{family}"))
    ct_conv, ct = boot_gates.declared_modules(str(tiny_checkpoints / f"ct{family}"))
    assert (mo_conv.name, ct_conv.name) == ("modelopt", "compressed-tensors")
    assert _formats(ct) == _formats(mo)
    assert "lm_head" in ct and not any(n.startswith("mtp.") for n in ct)  # the BF16 drafter stays out
    experts = [n for n in ct if ".mlp.experts." in n]
    assert bool(experts) == bool(family)
    assert boot_gates.checkpoint_needs(ct) == boot_gates.checkpoint_needs(mo) == ({"moe"} if family else set())
    # the ModelOpt map keeps the config's own order (the engine's renamed copy pairs by position)
    mo_cfg = json.loads((tiny_checkpoints / f"modelopt{family}" / "hf_quant_config.json").read_text())
    assert list(mo) == list(boot_gates.declared_layers(mo_cfg))


def _ct_copy(src, dst, edit) -> str:
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg["quantization_config"])
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_ct_ignore_list_and_regex_targets_decide_the_declared_modules(tiny_checkpoints, tmp_path):
    _, full = boot_gates.declared_modules(str(tiny_checkpoints / "ct-moe"))
    expert0 = r"re:.*layers\.0\.mlp\.experts\..*"

    def ignore(q):
        q["ignore"] = ["lm_head", expert0]
    _, ignored = boot_gates.declared_modules(_ct_copy(tiny_checkpoints / "ct-moe", tmp_path / "ign", ignore))
    gone = set(full) - set(ignored)
    assert "lm_head" in gone and any(".layers.0.mlp.experts." in n for n in gone)
    assert all(n == "lm_head" or ".layers.0.mlp.experts." in n for n in gone)
    assert any(".layers.1.mlp.experts." in n for n in ignored)

    def anchored(q):  # a regex that matches nothing: nothing declared, so nothing to cover
        for g in q["config_groups"].values():
            g["targets"] = [t.replace("re:^model", "re:^nomodel") for t in g["targets"]]
    _, none = boot_gates.declared_modules(_ct_copy(tiny_checkpoints / "ct-moe", tmp_path / "anc", anchored))
    assert set(none) == {"lm_head"}  # the one exact (non-regex) target
    assert boot_gates.checkpoint_needs(none) == set()


def test_skipped_moe_hook_fails_a_ct_moe_checkpoint(tiny_checkpoints):
    """The skipped_hooks gate learns 'moe' from the compressed-tensors declaration too."""
    _, declared = boot_gates.declared_modules(str(tiny_checkpoints / "ct-moe"))
    census = {"hooks_skipped": [{"hook": "qpn-moe-method", "needed_for": "moe", "engine": "cpu",
                                 "rank": 0}]}
    results = {r.name: r for r in boot_gates.evaluate(CPU, 0, {"ok": True, "completion_tokens": 1}, None,
                                                      census, set(), declared=declared)}
    assert results[boot_gates.GATE_SKIPPED_HOOKS].failed
    _, dense = boot_gates.declared_modules(str(tiny_checkpoints / "ct"))
    results = {r.name: r for r in boot_gates.evaluate(CPU, 0, {"ok": True, "completion_tokens": 1}, None,
                                                      census, set(), declared=dense)}
    assert not results[boot_gates.GATE_SKIPPED_HOOKS].failed


# ---- compressed-tensors per-module coverage (issue 15) -----------------------------------------
def _engine_module(engine_name: str) -> str:
    """The vLLM module an engine-named checkpoint module is served by (fused as vLLM fuses them)."""
    base, _, leaf = engine_name.rpartition(".")
    if ".mlp.experts." in engine_name:
        return engine_name.split(".mlp.experts.")[0] + ".mlp.experts." + ("w2" if leaf == "down_proj" else "w13")
    fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
             "up_proj": "gate_up_proj", "in_proj_qkv": "in_proj_qkvz", "in_proj_z": "in_proj_qkvz"}
    return f"{base}.{fused[leaf]}" if leaf in fused else engine_name


def _write_ct_rank(tmp_path, declared: dict, drop=(), off_qpn=(), unlisted=(), record=True, head=True) -> str:
    """One rank's census as the cpu engine writes it for a compressed-tensors (or INT4) checkpoint:
    every declared module served by its vLLM module (per-module ``declared`` in engine names) on its
    family's QPN route, and the overlay's {checkpoint name: engine name} record. ``drop``: vLLM
    modules not admitted; ``off_qpn``: admitted on a non-QPN route; ``unlisted``: checkpoint names
    left out of the record; ``head``: a QPN lm_head reported."""
    from qpn.kernels import formats

    route_of = {f.family: f.route_prefix for f in formats.WEIGHT_FORMATS}
    c = Census()
    c.platform = _PLATFORM
    c.rank, c.directory = 0, str(tmp_path)
    c._engine_config = types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(tensor_parallel_size=1),
        model_config=types.SimpleNamespace(max_model_len=1024, enforce_eager=True),
        speculative_config=None, compilation_config=types.SimpleNamespace(static_forward_context={}))
    names = {ck: _hub_to_vllm(ck) for ck in declared}
    served: dict[str, list[str]] = {}
    for ck, eng in names.items():
        served.setdefault(_engine_module(eng), []).append(eng)
    keep = []
    for module, engine_names in served.items():
        if module in drop:
            continue
        region = declared[next(ck for ck, e in names.items() if e == engine_names[0])].fmt
        layer = object()
        keep.append(layer)
        n = c.register_module(layer, module, region, 64, 128, prepack_verified=True, declared=engine_names)
        c.count(n, "marlin" if module in off_qpn else route_of[region])
    if record:
        c.set_checkpoint_modules({ck: e for ck, e in names.items() if ck not in unlisted})
    if head:
        c.set_lm_head("lm_head", "nvfp4", "checkpoint_codes", "qpn2")
    c._stop.set()
    return c.flush()


def _ct_gate(tmp_path, declared):
    return boot_gates.gate_qpn_routes(aggregate(str(tmp_path)), {"nvfp4", "fp8"}, boot_gates.qpn_route_names(),
                                      checkpoint_modules=declared)


@pytest.mark.parametrize("change, needle", [
    ({}, None),
    (dict(drop=("model.layers.6.mlp.experts.w2",)),
     "8 of 243 checkpoint module(s) declared by the checkpoint's config not in the census, "
     "e.g. ['model.language_model.layers.6.mlp.experts.0.down_proj (engine: model.layers.6.mlp.experts.0.down_proj)'"),
    (dict(drop=("model.layers.3.self_attn.qkv_proj",)), "3 of 243 checkpoint module(s)"),
    (dict(drop=("lm_head",)), "1 of 243 checkpoint module(s) declared by the checkpoint's config not in the census, e.g. ['lm_head']"),
    (dict(off_qpn=("model.layers.2.linear_attn.in_proj_qkvz",)),
     "2 checkpoint module(s) admitted but not on a QPN route, e.g. ['model.language_model.layers.2.linear_attn.in_proj_qkv'"),
    (dict(unlisted=("model.language_model.layers.0.mlp.experts.5.up_proj",)),
     "1 declared checkpoint module(s) missing from the engine's checkpoint_modules, "
     "e.g. ['model.language_model.layers.0.mlp.experts.5.up_proj']"),
    (dict(record=False), "the census has no checkpoint_modules"),
])
def test_ct_coverage_pairs_every_declared_module_by_name(tiny_checkpoints, tmp_path, change, needle):
    """qpn_routes on a compressed-tensors checkpoint: each module config_groups declare must be on a
    QPN route, found through the overlay's {checkpoint name: engine name} record. One vLLM module
    left off QPN (not admitted, or on a foreign route), one checkpoint name the record lacks, or no
    record at all fails naming the checkpoint modules."""
    _, declared = boot_gates.declared_modules(str(tiny_checkpoints / "ct-moe"))
    assert len(declared) == 243
    _write_ct_rank(tmp_path, declared, **change)
    gate = _ct_gate(tmp_path, declared)
    if needle is None:
        assert gate.status == boot_gates.PASS, gate.observed
        assert "declared modules (243)" in gate.expected
    else:
        assert gate.failed and needle in gate.observed, gate.observed


def test_ct_coverage_is_what_the_launcher_asks_for_a_ct_checkpoint(tiny_checkpoints, tmp_path):
    """evaluate() checks the coverage only when given the CT modules (run_gates passes them for a
    compressed-tensors checkpoint): the same census minus one expert stack passes the gate without
    them (module counts alone cannot see a module that never reached the census) and fails with."""
    _, declared = boot_gates.declared_modules(str(tiny_checkpoints / "ct-moe"))
    _write_ct_rank(tmp_path, declared, drop=("model.layers.1.mlp.experts.w13",))

    def qpn_routes(**kw):
        return {r.name: r for r in boot_gates.evaluate(CPU, 0, {"ok": True, "completion_tokens": 1}, None,
                                                       aggregate(str(tmp_path)), {"nvfp4", "fp8"},
                                                       tp=1, declared=declared, **kw)}["qpn_routes"]
    assert not qpn_routes().failed
    g = qpn_routes(checkpoint_modules=declared)
    assert g.failed and "16 of 243 checkpoint module(s)" in g.observed, g.observed


def _schemes(declared: dict) -> dict[str, tuple[str, str]]:
    return {name: (s.fmt, s.fp8_scale) for name, s in declared.items()}


def test_ct_class_targets_expand_over_the_checkpoints_own_tensors(tiny_checkpoints, tmp_path):
    """llm-compressor's usual form names the class Linear instead of modules: the declared set is
    then every module holding the scheme's codes in its dtype (weight_packed uint8 for NVFP4, an
    e4m3 weight for FP8), less ``ignore`` (names and re: patterns); name targets still come first.
    The class form must declare exactly the modules, formats and layouts the name form does: a
    dropped module (class targets matching nothing) or an added one (a BF16 router, norm,
    embedding or drafter weight taken for a Linear) fails."""
    src = tiny_checkpoints / "ct-moe"
    _, by_name = boot_gates.declared_modules(str(src))

    def nvfp4_linear(q):
        q["config_groups"]["group_0"]["targets"] = ["Linear"]
        q["ignore"] = [r"re:.*mlp\.gate$", r"re:.*shared_expert_gate$", "re:^mtp\\."]
    _, by_class = boot_gates.declared_modules(_ct_copy(src, tmp_path / "nvfp4", nvfp4_linear))
    assert _schemes(by_class) == _schemes(by_name)
    assert len(by_class) == 243 and sum(s.fmt == "nvfp4" for s in by_class.values()) == 217

    def fp8_linear(q):  # FP8 per tensor as the class target; the per-channel GDN group by name
        q["config_groups"]["group_1"]["targets"] = ["Linear"]
    _, fp8_class = boot_gates.declared_modules(_ct_copy(src, tmp_path / "fp8", fp8_linear))
    assert _schemes(fp8_class) == _schemes(by_name)

    def ignored(q):
        nvfp4_linear(q)
        q["ignore"] += ["lm_head", r"re:.*layers\.0\.mlp\.experts\."]
    _, fewer = boot_gates.declared_modules(_ct_copy(src, tmp_path / "ign", ignored))
    gone = set(by_name) - set(fewer)
    assert set(fewer) <= set(by_name) and "lm_head" in gone and len(gone) == 1 + 24
    assert all(n == "lm_head" or ".layers.0.mlp.experts." in n for n in gone)

    def unknown_class(q):  # a class QPN serves no codes for declares nothing by class
        q["config_groups"]["group_0"]["targets"] = ["Embedding"]
    _, none = boot_gates.declared_modules(_ct_copy(src, tmp_path / "emb", unknown_class))
    assert not any(s.fmt == "nvfp4" for s in none.values())


# ---- INT4 W4A16 checkpoints (issue 26 item 5): regions, declared modules, coverage, lm_head --------
@pytest.fixture(scope="module")
def int4_checkpoints(tmp_path_factory):
    """The INT4 generator's checkpoints of seed 0, one per convention and member."""
    from qpn.scripts.checkpoints import make_int4_checkpoint as mi

    root = tmp_path_factory.mktemp("declared-int4")
    mi.make_int4_checkpoint(root / "awq", "awq")
    mi.make_int4_checkpoint(root / "gptq", "gptq")
    mi.make_int4_checkpoint(root / "ct", "compressed-tensors")
    mi.make_int4_checkpoint(root / "ct-sym", "compressed-tensors", symmetric=True)
    return root


@pytest.mark.parametrize("name, convention, fmt", [("awq", "awq", "int4"), ("gptq", "gptq", "int4"),
                                                   ("ct", "compressed-tensors", "int4"),
                                                   ("ct-sym", "compressed-tensors", "int4_sym")])
def test_int4_checkpoints_declare_the_int4_region_and_their_modules(int4_checkpoints, name, convention, fmt):
    """What the launcher reads of an INT4 checkpoint: the 'int4' region (which the qpn_routes gate
    then requires admitted modules in), and every INT4 module with its scheme (the coverage and the
    TP plan read them); lm_head and the drafter are not among them (BF16 in these exports)."""
    from qpn.scripts.launcher import serve, serve_preflight

    ckpt = str(int4_checkpoints / name)
    cfg = serve.quant_config(ckpt, serve_preflight.load_checkpoint_config(ckpt))
    assert boot_gates.declared_regions(cfg) == {"int4"}
    conv, declared = boot_gates.declared_modules(ckpt)
    assert conv.name == convention and len(declared) == 50
    assert {s.format.key for s in declared.values()} == {fmt} and {s.group_size for s in declared.values()} == {32}
    assert not any(n == "lm_head" or n.startswith("mtp.") for n in declared)
    assert not boot_gates.head_declared(declared) and boot_gates.checkpoint_needs(declared) == set()
    # an INT4 config QPN does not serve declares no region (the preflight names why, or the engine serves it)
    if convention == "gptq":  # GPTQ's 8-bit form is the INT8 family's region
        assert boot_gates.declared_regions({**cfg, "bits": 8}) == {"int8"}
    assert boot_gates.declared_regions({**cfg, "bits": 3} if convention != "compressed-tensors" else
                                       {**cfg, "config_groups": {"g": {**cfg["config_groups"]["group_0"], "weights": {
                                           **cfg["config_groups"]["group_0"]["weights"], "group_size": 16}}}}) == set()


def _int4_gate(tmp_path, declared):
    return boot_gates.gate_qpn_routes(aggregate(str(tmp_path)), {"int4"}, boot_gates.qpn_route_names(),
                                      checkpoint_modules=declared)


@pytest.mark.parametrize("change, needle", [
    ({}, None),
    (dict(record=False), "rank 0: the census has no checkpoint_modules (the QPN quant config never reached "
                         "this rank, or could not read the checkpoint: see the engine log)"),
    (dict(drop=("model.layers.4.mlp.gate_up_proj",)),
     "2 of 50 checkpoint module(s) declared by the checkpoint's config not in the census, "
     "e.g. ['model.language_model.layers.4.mlp.gate_proj (engine: model.layers.4.mlp.gate_proj)', "
     "'model.language_model.layers.4.mlp.up_proj (engine: model.layers.4.mlp.up_proj)']"),
    (dict(off_qpn=("model.layers.3.self_attn.o_proj",)),
     "1 checkpoint module(s) admitted but not on a QPN route, e.g. ['model.language_model.layers.3.self_attn.o_proj']"),
    (dict(unlisted=("model.language_model.layers.2.linear_attn.out_proj",)),
     "1 declared checkpoint module(s) missing from the engine's checkpoint_modules, "
     "e.g. ['model.language_model.layers.2.linear_attn.out_proj']"),
])
@pytest.mark.parametrize("name", ["awq", "gptq", "ct"])
def test_int4_coverage_pairs_every_declared_module_by_name(int4_checkpoints, tmp_path, name, change, needle):
    """qpn_routes on an INT4 checkpoint of each convention (AWQ, GPTQ, compressed-tensors
    pack-quantized): its 50 declared modules on QPN routes (qpn4*), paired by name through the
    census's checkpoint_modules, which every rank records. A module the engine left out of the
    census or off QPN fails the gate naming the checkpoint module; so do a checkpoint name the
    record lacks and a rank with no record at all."""
    _, declared = boot_gates.declared_modules(str(int4_checkpoints / name))
    _write_ct_rank(tmp_path, declared, head=False, **change)
    gate = _int4_gate(tmp_path, declared)
    if needle is None:
        assert gate.status == boot_gates.PASS and "declared modules (50)" in gate.expected, gate.observed
        assert "qpn4=" in gate.observed and "int4" in gate.observed, gate.observed
    else:
        assert gate.failed and needle in gate.observed, gate.observed


def test_lm_head_gate_follows_what_the_checkpoint_declares(int4_checkpoints, tmp_path):
    """A checkpoint that leaves lm_head unquantized (the INT4 exports) passes lm_head_from_codes with
    no QPN head and fails when a rank reports one; one that quantizes it still needs the QPN head."""
    _, declared = boot_gates.declared_modules(str(int4_checkpoints / "ct"))
    _write_ct_rank(tmp_path / "none", declared, head=False)
    gate = boot_gates.gate_lm_head(aggregate(str(tmp_path / "none")), boot_gates.qpn_route_names(), declared)
    assert gate.status == boot_gates.PASS and "leaves lm_head unquantized" in gate.expected, gate
    _write_ct_rank(tmp_path / "head", declared, head=True)
    gate = boot_gates.gate_lm_head(aggregate(str(tmp_path / "head")), boot_gates.qpn_route_names(), declared)
    assert gate.failed and "1 rank(s) report a QPN lm_head: lm_head from checkpoint_codes" in gate.observed, gate
    with_head = {**declared, "lm_head": next(iter(declared.values()))}
    assert boot_gates.head_declared(with_head) and boot_gates.head_declared(None)
    gate = boot_gates.gate_lm_head(aggregate(str(tmp_path / "none")), boot_gates.qpn_route_names(), with_head)
    assert gate.failed and "no lm_head entry" in gate.observed, gate
