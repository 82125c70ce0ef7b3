"""Run inside a 1Cat-vLLM source tree (first on sys.path, QPN_ENGINE=sm70): a real FusedMoE layer
of 1Cat, built under the registered QPN config (the plugin registered; QPNConfig over 1Cat's own
ModelOpt mixed config), must get the QPN MoE method through 1Cat's own closure; its checkpoint
tensors go through 1Cat's FusedMoE.weight_loader; the output matches a float64 SwiGLU MoE computed
from the checkpoint tensors directly. A layer whose experts the checkpoint does not list keeps
1Cat's own (unquantized) method, and 1Cat's real linear layers under the same config get the QPN
linear methods. Prints one JSON line (tests/test_moe_1cat.py).
"""
import json
import socket

import torch

from qpn.fork_patches.engine import plugin
from qpn.kernels.families.nvfp4 import codec as nvfp4_codec

plugin.register()

from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed import init_distributed_environment, initialize_model_parallel  # noqa: E402
from vllm.model_executor.layers.fused_moe import FusedMoE  # noqa: E402
from vllm.model_executor.layers.linear import RowParallelLinear  # noqa: E402
from vllm.model_executor.layers.quantization import get_quantization_config  # noqa: E402

E, H, I, TOP_K, T = 4, 64, 32, 2, 6
PREFIX = "model.layers.0.mlp.experts"


def mixed_config(with_experts: bool):
    """The registered QPN config ("qpn", as 1Cat's registry returns it) over a mixed ModelOpt config."""
    layers = {"model.layers.0.self_attn.o_proj": {"quant_algo": "FP8"},
              "model.layers.1.self_attn.o_proj": {"quant_algo": "NVFP4", "group_size": 16}}
    if with_experts:
        layers.update({f"{PREFIX}.{e}.{p}": {"quant_algo": "NVFP4", "group_size": 16}
                       for e in range(E) for p in ("gate_proj", "up_proj", "down_proj")})
    return get_quantization_config("qpn").from_config(
        {"producer": {"name": "modelopt"}, "quant_method": "modelopt",
         "quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers}})


out = {}
s = socket.socket()
s.bind(("127.0.0.1", 0))
port = s.getsockname()[1]
s.close()
with set_current_vllm_config(VllmConfig()):
    init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                 local_rank=0, backend="gloo")
    initialize_model_parallel(1, 1)
    dense = FusedMoE(num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I, params_dtype=torch.bfloat16,
                     quant_config=mixed_config(False), prefix="model.layers.1.mlp.experts")
    out["dense_method"] = type(dense.quant_method).__name__
    layer = FusedMoE(num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I, params_dtype=torch.bfloat16,
                     quant_config=mixed_config(True), prefix=PREFIX)
    method = layer.quant_method
    out["method"] = type(method).__name__
    out["algo"] = getattr(method, "algo", None)
    out["config"] = layer.quant_config.get_name()

    def served(m):  # the method's class, and the family it serves where it is QPN's
        return type(m).__name__ + (f" {m.fmt}" if hasattr(m, "fmt") else "")

    out["linear"] = {p: served(RowParallelLinear(H, H, bias=False, quant_config=mixed_config(False),
                                                 prefix=p).quant_method)
                     for p in ("model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj",
                               "model.layers.2.self_attn.o_proj")}
    gen = torch.Generator().manual_seed(7)
    weights = {}
    for e in range(E):
        for shard, (n, k) in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
            q, sc, s2 = nvfp4_codec.quantize(torch.randn((n, k), generator=gen) * 0.1)
            weights[(e, shard)] = (q, sc, s2)
            stem = "w2" if shard == "w2" else "w13"
            for name, t in ((f"{stem}_weight", q), (f"{stem}_weight_scale", sc), (f"{stem}_weight_scale_2", s2),
                            (f"{stem}_input_scale", torch.tensor(0.01))):
                param = getattr(layer, name)
                # 1Cat's own loader (FusedMoE.weight_loader), reached through the parameter
                param.weight_loader(param, t, weight_name=f"{PREFIX}.{e}.{name}", shard_id=shard, expert_id=e,
                                    return_success=True)
    method.process_weights_after_loading(layer)
    x = (torch.randn((T, H), generator=gen) * 0.5).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(T)]).to(torch.int32)
    w = torch.softmax(torch.randn((T, TOP_K), generator=gen), dim=1)
    y = method.apply(layer, x, w, ids).double()
    ref = torch.zeros((T, H), dtype=torch.float64)
    deq = {key: nvfp4_codec.dequantize_f64(*v) for key, v in weights.items()}
    for t in range(T):
        for j in range(TOP_K):
            e = int(ids[t, j])
            xi = x[t].double()
            h = torch.nn.functional.silu(deq[(e, "w1")] @ xi) * (deq[(e, "w3")] @ xi)
            ref[t] += float(w[t, j]) * (deq[(e, "w2")] @ h)
    out["max_abs_err"] = float((y - ref).abs().max())
    out["ref_max"] = float(ref.abs().max())
    # a permuted expert must change the answer (the test can fail): swap experts 0 and 1 in ids
    swapped = ids.clone()
    swapped[ids == 0], swapped[ids == 1] = 1, 0
    out["swapped_err"] = float((method.apply(layer, x, w, swapped).double() - ref).abs().max())

    # compressed-tensors: the QPN config over 1Cat's CompressedTensorsConfig hands out the experts'
    # method; tensors made by the library's own compressor (gate and up with different global scales)
    # load through 1Cat's generic FusedMoE.weight_loader path.
    from _ct_library import ct_decompress_nvfp4, ct_nvfp4

    from qpn.scripts.checkpoints.make_ct_checkpoint import quantization_config

    ct_prefix = "model.layers.2.mlp.experts"
    ct_config = get_quantization_config("qpn").from_config(quantization_config(moe=True))
    out["ct_inner"] = type(ct_config._inner).__name__
    ct_layer = FusedMoE(num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I, params_dtype=torch.bfloat16,
                        quant_config=ct_config, prefix=ct_prefix)
    ct_method = ct_layer.quant_method
    out["ct_method"] = type(ct_method).__name__
    ct_deq = {}
    for e in range(E):
        for shard, (n, k) in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
            gain = 0.4 if shard == "w1" else 0.1
            tensors = ct_nvfp4(torch.randn((n, k), generator=gen) * gain)
            ct_deq[(e, shard)] = ct_decompress_nvfp4(tensors).double()
            stem = "w2" if shard == "w2" else "w13"
            for suffix, t in tensors.items():
                param = getattr(ct_layer, f"{stem}_{suffix}")
                param.weight_loader(param, t, weight_name=f"{ct_prefix}.{stem}_{suffix}", shard_id=shard,
                                    expert_id=e, return_success=True)
    ct_method.process_weights_after_loading(ct_layer)
    ct_ref = torch.zeros((T, H), dtype=torch.float64)
    for t in range(T):
        for j in range(TOP_K):
            e = int(ids[t, j])
            xi = x[t].double()
            h = torch.nn.functional.silu(ct_deq[(e, "w1")] @ xi) * (ct_deq[(e, "w3")] @ xi)
            ct_ref[t] += float(w[t, j]) * (ct_deq[(e, "w2")] @ h)
    out["ct_max_abs_err"] = float((ct_method.apply(ct_layer, x, w, ids).double() - ct_ref).abs().max())
    out["ct_ref_max"] = float(ct_ref.abs().max())
    out["ct_swapped_err"] = float((ct_method.apply(ct_layer, x, w, swapped).double() - ct_ref).abs().max())
print("QPN_MOE_1CAT " + json.dumps(out))
