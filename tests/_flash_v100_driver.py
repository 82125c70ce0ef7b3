"""Drive 1Cat-vLLM's real FlashAttention-V100 route decisions on the CPU (run on the engine's
python with an extracted 1Cat archive first on PYTHONPATH; prints one JSON object).

The backend's kernels need a V100, so the two kernel entry points of each implementation are
replaced by recorders: what is exercised is the engine's own Python that picks XQA or scalar
(``_flash_v100_decode``, ``_call_flash_attn_smallq_decode_paged``) and its KV-dtype handling.
Our hooks are applied through the plugin's own ``apply_runtime_hook`` for ``ENGINE_KEY``
(argv[1], e.g. ``sm70@1.2.2``), after one implementation is built without them.

Usage: python tests/_flash_v100_driver.py ENGINE_KEY CASES_JSON
  CASES_JSON: a list of {phase, heads, kv_heads, head_size, kv, tensor, hint, window, rows}
"""
from __future__ import annotations

import json
import sys
import types


def _impl(fa, heads, kv_heads, head_size, kv, window=None):
    from vllm.v1.attention.backends.flash_attn_v100 import FlashAttnV100Impl

    impl = FlashAttnV100Impl(heads, head_size, head_size ** -0.5, kv_heads, None, window, kv)
    calls = []

    def recorder(kind):
        def op(query, key_cache, value_cache, block_table, seq_lens, **kwargs):
            calls.append({"kernel": kind, "kv_cache_dtype": kwargs.get("kv_cache_dtype")})
        return op

    impl.flash_attn_decode_paged_xqa = recorder("xqa")
    impl.flash_attn_decode_paged = recorder("scalar")
    impl._flash_decode_paged_kwargs = {"window_size", "max_seq_len_hint",
                                       "workspace_seq_capacity_hint", "active_num_partitions",
                                       "partition_size_hint"}
    impl.use_decode_xqa = impl.use_smallq_decode_xqa = True
    return impl, calls


def run_case(fa, case):
    import torch

    heads, kv_heads, head = case["heads"], case["kv_heads"], case["head_size"]
    impl, calls = _impl(fa, heads, kv_heads, head, case["kv"], case.get("window"))
    tensor = {"float16": torch.float16, "uint8": torch.uint8, "bfloat16": torch.bfloat16}[case["tensor"]]
    rows = case.get("rows", 1)
    page = 16
    key = torch.zeros(4, page, kv_heads, head, dtype=tensor)
    val = torch.zeros_like(key)
    layer = types.SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0)
    seq_lens = torch.full((rows,), 32, dtype=torch.int32)
    block_table = torch.zeros(rows, 4, dtype=torch.int32)
    hint = case.get("hint")
    out = torch.zeros(rows, heads, head, dtype=torch.float16)
    query = torch.zeros(rows, heads, head, dtype=torch.float16)
    if case["phase"] == "decode":
        meta = types.SimpleNamespace(
            num_actual_tokens=rows, seq_lens=seq_lens, block_table=block_table,
            flash_v100_decode_max_seq_len_hint=hint, flash_v100_static_decode_seq_hint=None,
            flash_v100_decode_workspace_seq_capacity_hint=hint,
            flash_v100_decode_active_num_partitions=None, flash_v100_cudagraph_capture=False)
        impl._flash_v100_decode(layer, query, None, None, (key, val), meta, out)
    else:
        meta = types.SimpleNamespace(flash_v100_cudagraph_capture=False)
        impl._call_flash_attn_smallq_decode_paged(
            layer, query, key, val, block_table, seq_lens, meta, out=out,
            max_seq_len_hint=hint, workspace_seq_capacity_hint=hint, partition_size_hint=None)
    return {"impl_kv_cache_dtype": impl.kv_cache_dtype, "calls": calls}


def main() -> None:
    engine_key, cases = sys.argv[1], json.loads(sys.argv[2])
    import vllm.config  # noqa: F401 - the engine's own import order
    from vllm.v1.attention.backends import flash_attn_v100 as fa

    from qpn.fork_patches.engine import hooks, plugin
    from qpn.fork_patches.route_census.census import CENSUS

    # before our hooks: what the engine alone keeps for an explicit float16 cache
    unhooked = _impl(fa, 6, 1, 256, "float16")[0].kv_cache_dtype
    applied = []
    for hook in hooks.hooks_for(engine_key, kind="runtime"):
        if hook.anchor_for(engine_key).startswith("vllm.v1.attention.backends.flash_attn_v100:"):
            plugin.apply_runtime_hook(hook, engine_key)
            applied.append(hook.name)
    results = []
    for case in cases:
        before = json.loads(json.dumps(CENSUS.attention_routes))
        got = run_case(fa, case)
        after = CENSUS.attention_routes
        got["routes"] = {r: after[r]["eager"] - before.get(r, {}).get("eager", 0)
                         for r in after if after[r]["eager"] != before.get(r, {}).get("eager", 0)}
        results.append(got)
    print(json.dumps({"vllm_file": fa.__file__, "unhooked_float16": unhooked, "applied": applied,
                      "results": results}))


if __name__ == "__main__":
    main()
