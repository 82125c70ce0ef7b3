"""Tensor-parallel sharding rules at TP 2 and 4 on Qwen3.8-27B's real per-rank shapes
(seed 000's model), through vLLM's own parameter loaders (``vllm/model_executor/parameter.py``
and ``VocabParallelEmbedding.weight_loader``) with the tensor-parallel rank and size they read
patched in: row-parallel splits keep whole NVFP4 groups and whole k-blocks per rank, FP8 per-shard
scales stay per shard, the vocab-parallel lm_head keeps its codes; and a checkpoint that cannot be
split at the asked TP is refused before boot, naming the module."""
from __future__ import annotations

import json
import struct
from types import SimpleNamespace

import pytest
import torch

from qpn.fork_patches.quant import tp_sharding as tps
from qpn.kernels.families.nvfp4 import codec as nvfp4_codec
from qpn.kernels.families.nvfp4 import layout as nvfp4_layout
from qpn.kernels.atoms import KNOWN_ATOMS
from qpn.scripts.launcher import serve_preflight

pytestmark = pytest.mark.fast

# Qwen3.8-27B (seed 000): hidden 5120, MLP 17408, vocab 248320; full
# attention 24 query heads (gated: q_proj 2 x 24 x 256 rows), 4 KV heads, head 256; gated delta
# net 16 key heads x 128 and 48 value heads x 128 (in_proj_qkvz 16384 rows, out_proj K 6144).
H, I, V = 5120, 17408, 248320
QWEN38 = [
    tps.Module("layers.0.linear_attn.in_proj_qkvz", "fp8", (2048, 2048, 6144, 6144), H),
    tps.Module("layers.0.linear_attn.out_proj", "fp8", (H,), 6144),
    tps.Module("layers.3.self_attn.qkv_proj", "fp8", (12288, 1024, 1024), H),
    tps.Module("layers.3.self_attn.o_proj", "fp8", (H,), 6144),
    tps.Module("layers.0.mlp.gate_up_proj", "nvfp4", (I, I), H),
    tps.Module("layers.0.mlp.down_proj", "nvfp4", (H,), I),
    tps.Module("lm_head", "nvfp4", (V,), H),
]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qwen38_splits_cleanly_with_the_design_shapes(tp):
    shapes, issues = tps.plan(QWEN38, tp)
    assert issues == []
    by = {s.name.rsplit(".", 1)[-1]: s for s in shapes}
    assert (by["lm_head"].n, by["lm_head"].k) == (V // tp, H)  # 62080 x 5120 at TP4
    assert by["down_proj"].k == I // tp and by["down_proj"].n == H
    assert by["o_proj"].k == by["out_proj"].k == 6144 // tp
    assert by["qkv_proj"].output_sizes == (12288 // tp, 1024 // tp, 1024 // tp)
    if tp == 4:
        assert by["lm_head"].n == 62080 and by["down_proj"].k == 4352


@pytest.mark.parametrize("tp,needle", [
    (3, "layers.0.mlp.down_proj: row-parallel input K=17408 does not divide by TP=3"),
    (3, "lm_head: vocab-parallel output N=248320 does not divide by TP=3"),
])
def test_unsplittable_tp_names_the_module(tp, needle):
    _, issues = tps.plan(QWEN38, tp)
    assert needle in issues


def test_split_inside_a_group_or_k_block_is_refused():
    groups = tps.problems(tps.Module("x.down_proj", "nvfp4", (64,), 48), 2)  # 24 per rank
    assert any("splits an NVFP4 group" in p for p in groups)
    blocks = tps.problems(tps.Module("x.down_proj", "nvfp4", (64,), 96), 2)  # 48 per rank
    assert not any("NVFP4 group" in p for p in blocks)
    assert any("m8n8k4 k-blocks (32 inputs)" in p for p in blocks)
    assert any("m16n8k16 k-blocks (64 inputs)" in p for p in blocks)
    fp8 = tps.problems(tps.Module("x.o_proj", "fp8", (64,), 96), 2)  # FP8: k-blocks only
    assert fp8 and not any("NVFP4" in p for p in fp8)


@pytest.fixture
def tp_rank(monkeypatch):
    """Set the tensor-parallel rank and size vLLM's parameters read at construction."""
    import vllm.model_executor.parameter as param_mod

    def set_rank(rank: int, size: int):
        monkeypatch.setattr(param_mod, "get_tensor_model_parallel_rank", lambda: rank)
        monkeypatch.setattr(param_mod, "get_tensor_model_parallel_world_size", lambda: size)
    return set_rank


def _nvfp4(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    scale_bytes = torch.randint(0, 0x7F, (n, k // 16), generator=g, dtype=torch.uint8)
    return codes, scale_bytes.view(torch.float8_e4m3fn)


@pytest.mark.parametrize("tp", [2, 4])
def test_row_parallel_nvfp4_keeps_whole_groups_and_k_blocks(tp, tp_rank):
    from vllm.model_executor.parameter import ModelWeightParameter

    n, k = 32, I  # down_proj's real K, a few rows
    codes, scales = _nvfp4(n, k, seed=tp)
    full = nvfp4_codec.dequantize(codes, scales, torch.tensor(0.5))
    pieces = []
    for rank in range(tp):
        tp_rank(rank, tp)
        p_codes = ModelWeightParameter(data=torch.empty(n, k // tp // 2, dtype=torch.uint8),
                                       input_dim=1, output_dim=0, weight_loader=None)
        p_scales = ModelWeightParameter(data=torch.empty(n, k // tp // 16, dtype=torch.float8_e4m3fn),
                                        input_dim=1, output_dim=0, weight_loader=None)
        p_codes.load_row_parallel_weight(codes)
        p_scales.load_row_parallel_weight(scales)
        # whole groups: this rank's codes and scales describe exactly its slice of the weight
        mine = nvfp4_codec.dequantize(p_codes.data, p_scales.data, torch.tensor(0.5))
        assert torch.equal(mine, full[:, rank * k // tp:(rank + 1) * k // tp])
        for atom in KNOWN_ATOMS:  # whole k-blocks: no padding inside the rank's K
            packed = nvfp4_layout.prepack(p_codes.data, p_scales.data, torch.tensor(0.5), atom=atom)
            assert packed.k_pad == packed.k == k // tp
            nvfp4_layout.verify_roundtrip(packed, p_codes.data, p_scales.data)
        pieces.append(mine)
    assert torch.equal(torch.cat(pieces, dim=1), full)
    x = torch.randn(3, k, dtype=torch.float64)
    partial = sum(x[:, r * k // tp:(r + 1) * k // tp] @ pieces[r].double().T for r in range(tp))
    torch.testing.assert_close(partial, x @ full.double().T)  # the all-reduce of the ranks


@pytest.mark.parametrize("tp", [2, 4])
def test_fp8_per_shard_scales_stay_per_shard(tp, tp_rank):
    """qkv_proj at TP: every rank keeps q, k and v's own scales, and QPN8's prepack gives each
    of its rows its shard's scale (no requantization, no shared scale)."""
    from vllm.model_executor.parameter import PerTensorScaleParameter

    from qpn.fork_patches.quant.linear_method import qpn_linear_method

    shard_scales = {"q": 0.011, "k": 0.023, "v": 0.037}
    sizes = (12288 // tp, 1024 // tp, 1024 // tp)  # per-rank q, k, v rows
    kk = 64  # a few input columns: the rule is about rows and scales
    for rank in range(tp):
        tp_rank(rank, tp)
        p = PerTensorScaleParameter(data=torch.empty(3, dtype=torch.float32), weight_loader=None)
        for shard, value in shard_scales.items():
            p.load_qkv_weight(torch.tensor(value), shard_id=shard)
        assert p.data.tolist() == pytest.approx(list(shard_scales.values()))
        method = qpn_linear_method("layers.3.self_attn.qkv_proj", "FP8", {"backend": "reference"})
        method.partition_sizes, method.n, method.k = list(sizes), sum(sizes), kk
        w = torch.randn(sum(sizes), kk).to(torch.float8_e4m3fn)
        method.prepack(SimpleNamespace(weight=SimpleNamespace(data=w), weight_scale=SimpleNamespace(data=p.data)))
        (_, _, packed) = method.pieces[0]
        assert packed.per_channel
        bounds = [0, sizes[0], sizes[0] + sizes[1], sum(sizes)]
        for (lo, hi), value in zip(zip(bounds, bounds[1:]), shard_scales.values()):
            assert torch.all(packed.scale[lo:hi] == torch.tensor(value, dtype=torch.float32))


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_lm_head_keeps_its_codes(tp):
    """VocabParallelEmbedding's own loader on the real vocabulary: each rank's head rows are the
    checkpoint's bytes for its vocabulary range (codes and group scales alike), none lost."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding, pad_vocab_size

    k = 64  # input columns kept small; the rule is about vocabulary rows
    codes, scales = _nvfp4(V, k, seed=7)
    padded = pad_vocab_size(V)
    got_codes, got_scales = [], []
    for rank in range(tp):
        idx = VocabParallelEmbedding._get_indices(padded, padded, V, V, rank, tp)
        layer = SimpleNamespace(shard_indices=idx, org_vocab_size=V)
        rows = padded // tp
        pc = torch.nn.Parameter(torch.empty(rows, k // 2, dtype=torch.uint8), requires_grad=False)
        ps = torch.nn.Parameter(torch.empty(rows, k // 16, dtype=torch.float8_e4m3fn), requires_grad=False)
        pc.output_dim = ps.output_dim = 0
        VocabParallelEmbedding.weight_loader(layer, pc, codes)
        VocabParallelEmbedding.weight_loader(layer, ps, scales)
        assert rows == V // tp  # 62080 at TP4: no padding rows with this vocabulary
        got_codes.append(pc.data)
        got_scales.append(ps.data.view(torch.uint8))
    assert torch.equal(torch.cat(got_codes), codes)
    assert torch.equal(torch.cat(got_scales), scales.view(torch.uint8))


# ------------------------------------------------------------------ refused before boot (preflight)
def _write_safetensors(path, shapes: dict[str, list[int]]):
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 1
        for s in shape:
            size *= s
        header[name] = {"dtype": "U8", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)


def test_preflight_refuses_a_checkpoint_that_cannot_be_split(tmp_path):
    layers = {"model.layers.0.mlp.down_proj": {"quant_algo": "NVFP4"},
              "model.layers.0.mlp.gate_proj": {"quant_algo": "NVFP4"},
              "model.layers.0.mlp.up_proj": {"quant_algo": "NVFP4"},
              "model.layers.0.self_attn.o_proj": {"quant_algo": "FP8"}}
    _write_safetensors(tmp_path / "model.safetensors", {
        "model.layers.0.mlp.down_proj.weight": [128, 24],   # K = 48: 24 per rank at TP2
        "model.layers.0.mlp.gate_proj.weight": [48, 64],
        "model.layers.0.mlp.up_proj.weight": [48, 64],
        "model.layers.0.self_attn.o_proj.weight": [128, 256],
    })
    quant = {"quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers}}
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(quant))
    modules = {m.name: m for m in tps.checkpoint_modules(str(tmp_path), layers)}
    assert modules["model.layers.0.mlp.gate_up_proj"].output_sizes == (48, 48)
    assert modules["model.layers.0.mlp.down_proj"].k == 48
    assert serve_preflight.check_tp_split(str(tmp_path), 1) == "single rank"
    with pytest.raises(serve_preflight.Refusal) as err:
        serve_preflight.check_tp_split(str(tmp_path), 2)
    assert "model.layers.0.mlp.down_proj" in str(err.value) and "NVFP4 group" in str(err.value)
    assert "o_proj" not in str(err.value)  # 128 per rank: whole k-blocks of both atoms
    with pytest.raises(serve_preflight.Refusal, match="gate_up_proj: column-parallel output N=48"):
        serve_preflight.check_tp_split(str(tmp_path), 32)


def test_preflight_plans_a_compressed_tensors_checkpoint(tmp_path):
    """The same split rules on a compressed-tensors declaration (config_groups targets, codes in
    ``weight_packed``): the preflight reads the modules the convention declares, not ModelOpt's
    quantized_layers only."""
    from qpn.scripts.checkpoints.make_ct_checkpoint import quantization_config

    _write_safetensors(tmp_path / "model.safetensors", {
        "model.layers.0.mlp.down_proj.weight_packed": [128, 24],   # K = 48: 24 per rank at TP2
        "model.layers.0.mlp.gate_proj.weight_packed": [48, 32],
        "model.layers.0.mlp.up_proj.weight_packed": [48, 32],
        "model.layers.0.self_attn.o_proj.weight": [128, 256],
        "model.layers.0.mlp.router.weight": [8, 64],  # matches no target: not planned
    })
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": quantization_config()}))
    assert serve_preflight.check_tp_split(str(tmp_path), 1) == "single rank"
    with pytest.raises(serve_preflight.Refusal) as err:
        serve_preflight.check_tp_split(str(tmp_path), 2)
    assert "model.layers.0.mlp.down_proj: row-parallel K=48/TP=2" in str(err.value)
    assert "o_proj" not in str(err.value)
    with pytest.raises(serve_preflight.Refusal, match="gate_up_proj: column-parallel output N=48"):
        serve_preflight.check_tp_split(str(tmp_path), 32)
    from qpn.scripts.launcher.boot_gates import declared_modules

    convention, declared = declared_modules(str(tmp_path))
    planned = {m.name: m for m in tps.checkpoint_modules(str(tmp_path), declared, convention)}
    assert planned == {
        "model.layers.0.mlp.down_proj": tps.Module("model.layers.0.mlp.down_proj", "nvfp4", (128,), 48),
        "model.layers.0.mlp.gate_up_proj": tps.Module("model.layers.0.mlp.gate_up_proj", "nvfp4", (48, 48), 64),
        "model.layers.0.self_attn.o_proj": tps.Module("model.layers.0.self_attn.o_proj", "fp8", (128,), 256),
    }
    cfg = quantization_config()
    cfg["config_groups"]["group_1"]["weights"]["strategy"] = "block"  # block FP8: not served
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": cfg}))
    with pytest.raises(serve_preflight.Refusal, match="cannot plan the split.*per-tensor or per-channel"):
        serve_preflight.check_tp_split(str(tmp_path), 2)


def test_cpu_engine_binds_one_core_group_per_rank():
    from qpn.scripts.launcher.engine_profiles import CPU, SM70, cpu_threads_bind, tp_env

    assert tp_env(CPU, 2, cpus=[0, 1]) == {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    assert cpu_threads_bind(2, list(range(8))) == "0-3|4-7"
    assert cpu_threads_bind(4, [0, 2, 4, 6, 8, 10, 12, 14]) == "0,2|4,6|8,10|12,14"
    assert tp_env(CPU, 1, cpus=[0, 1]) == {} and tp_env(SM70, 4, cpus=[0]) == {}
    with pytest.raises(ValueError, match="TP=4 on the cpu engine needs at least 4 cores"):
        tp_env(CPU, 4, cpus=[0, 1])


# ---- INT4 W4A16 (issue 26 item 5): the checkpoint's own group size, words packing output rows ------
def test_int4_split_keeps_whole_groups_of_the_checkpoints_size_and_whole_words():
    """An INT4 row-parallel split needs K/TP to hold whole groups of the module's own group size
    (not the format's default 128), and a layout that packs eight output rows per int32 needs a
    multiple of 8 rows per rank in each fused partition."""
    down = tps.Module("layers.0.mlp.down_proj", "int4", (128,), 256, group=32)
    assert tps.plan([down], 4)[1] == []
    assert not any("group" in i for i in tps.plan([down], 8)[1])   # 32 inputs: one group (a k-block short)
    wide = tps.Module("layers.0.mlp.down_proj", "int4", (128,), 256, group=128)
    assert tps.plan([wide], 2)[1] == []
    (issue,) = tps.plan([wide], 4)[1]
    assert issue == ("layers.0.mlp.down_proj: row-parallel K=256/TP=4 = 64 inputs per rank splits an "
                     "INT4 W4A16 group (one float16 scale per 128 inputs)")
    kv = tps.Module("layers.3.self_attn.qkv_proj", "int4", (256, 32, 32), 128, group=32, rows_per_word=8)
    assert tps.plan([kv], 4)[1] == []
    (issue,) = tps.plan([kv], 8)[1][:1]
    assert "fused output partition 1: 32 rows)/TP=8 = 4 rows per rank is not a whole number of stored words " \
           "(8 output rows each)" in issue
    assert tps.plan([tps.Module("x.k_proj", "int4", (32,), 128, group=32)], 8)[1] == []  # no packed N


@pytest.fixture(scope="module")
def int4_ckpts(tmp_path_factory):
    pytest.importorskip("tokenizers")
    from qpn.scripts.checkpoints import make_int4_checkpoint as mi

    root = tmp_path_factory.mktemp("tp-int4")
    mi.make_int4_checkpoint(root / "awq128", "awq", group_size=128)
    mi.make_int4_checkpoint(root / "ct-sym", "compressed-tensors", symmetric=True)
    return root


def test_preflight_plans_int4_checkpoints_from_their_headers(int4_ckpts):
    """The launcher's TP plan of an INT4 checkpoint: every module's (N, K) from the convention's
    layout (AWQ stores codes [K, N/8]), the scheme's group size, and whether the layout packs
    output rows. TP=2 keeps whole groups of 128 on every row-parallel module (K = 256: one group
    per rank); TP=4 would cut them and is refused naming the module."""
    from qpn.scripts.launcher.boot_gates import declared_modules

    conv, declared = declared_modules(str(int4_ckpts / "awq128"))
    modules = {m.name: m for m in tps.checkpoint_modules(str(int4_ckpts / "awq128"), declared, conv)}
    down = modules["model.language_model.layers.0.mlp.down_proj"]
    assert (down.region, down.output_sizes, down.k, down.group, down.rows_per_word) == ("int4", (128,), 256, 128, 8)
    assert modules["model.language_model.layers.3.self_attn.qkv_proj"].output_sizes == (512, 128, 128)
    assert serve_preflight.check_tp_split(str(int4_ckpts / "awq128"), 2) == f"{len(modules)} quantized module(s) split over 2 ranks"
    with pytest.raises(serve_preflight.Refusal) as err:
        serve_preflight.check_tp_split(str(int4_ckpts / "awq128"), 4)
    assert "layers.0.mlp.down_proj: row-parallel K=256/TP=4 = 64 inputs per rank splits an INT4 W4A16 group " \
           "(one float16 scale per 128 inputs)" in str(err.value)
    # compressed-tensors symmetric: codes [N, K/8] pack inputs and there is no zero-point tensor
    conv, declared = declared_modules(str(int4_ckpts / "ct-sym"))
    sym = tps.checkpoint_modules(str(int4_ckpts / "ct-sym"), declared, conv)
    assert {(m.group, m.rows_per_word) for m in sym} == {(32, 1)} and len(sym) == len(modules)
