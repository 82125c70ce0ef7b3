"""Write a small ModelOpt-format MIXED_PRECISION checkpoint of the Qwen3.5/3.8 hybrid family.

    python -m qpn.scripts.checkpoints.make_checkpoint OUT_DIR [--seed S] [--malformed KIND] [--embed-config]
        [--embed-without-layers]

The checkpoint has the layout NVIDIA ModelOpt's ``export_hf_checkpoint`` writes for a mixed
FP8/NVFP4 model, with true encodings (qpn.kernels.fp8_codec.quantize / quantize_nvfp4):

* FP8 (e4m3, per-tensor ``weight_scale``, static ``input_scale``): ``linear_attn.in_proj_qkv``,
  ``linear_attn.in_proj_z``, ``linear_attn.out_proj``, ``self_attn.q_proj/k_proj/v_proj``,
  ``self_attn.o_proj``. Each shard of a fused projection keeps its own scale (q, k and v differ),
  which vLLM 0.32 can only serve by requantizing them to one scale.
* NVFP4 (uint8 codes, e4m3 ``weight_scale`` per 16 inputs, float32 ``weight_scale_2``,
  ``input_scale``): ``mlp.gate_proj/up_proj/down_proj`` and ``lm_head``; gate and up share one
  global scale, as ModelOpt's export makes them.
* BF16: embeddings, norms, the GDN convolution and its small ``in_proj_b/in_proj_a``, the MTP head.
* FP8 KV-cache scales ``self_attn.k_proj.k_scale`` / ``v_proj.v_scale`` (amax / 448).
* Names as ModelOpt 0.47 writes them for this family: the trunk under ``model.language_model.``,
  then ``lm_head`` and ``mtp.*``.
* ``hf_quant_config.json``: ``producer`` modelopt, ``quant_algo`` ``MIXED_PRECISION``, the
  per-module ``quantized_layers`` map, ``kv_cache_quant_algo`` ``FP8``.
  ``--embed-config`` also writes the ``quantization_config`` that ModelOpt >= 0.31 embeds in
  config.json; without it the checkpoint declares its quantization only in
  hf_quant_config.json (the older ModelOpt form), which vLLM 0.32 rejects at config parsing.
  ``--embed-without-layers`` embeds it without the ``quantized_layers`` map, which such a
  checkpoint keeps only in hf_quant_config.json (the form vLLM's get_quant_config falls back
  to the file for).

With the same float weights, every quantized tensor (codes, scales, global scales, activation
and KV scales) is byte-identical to what ModelOpt 0.47's ``export_hf_checkpoint`` writes from a
float32 model (tests/test_checkpoint_modelopt.py). ModelOpt exporting in bfloat16 rounds
weight/scale to bfloat16 before the FP8/FP4 cast, so a few codes land one step away there.

Activation scales (``input_scale``) come from a calibration pass of the float model in
transformers over a fixed text, like ModelOpt's max calibration: amax / 448 for FP8 inputs,
amax / (6 * 448) for NVFP4 inputs.

``--malformed KIND`` writes a broken variant for the loader's error tests (see MALFORMED).
The checkpoint is built in a temporary folder next to OUT_DIR and renamed into place only
when complete, so a failure never leaves a half-written checkpoint behind.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from qpn.kernels import families, formats
from qpn.kernels.families.nvfp4 import codec as nvfp4_codec
from qpn.scripts.checkpoints import tiny_hybrid, tiny_tokenizer

MODELOPT_VERSION_FORM = "0.47.0"  # the ModelOpt release whose export layout this mirrors


@dataclass(frozen=True)
class Malformed:
    kind: str
    tensor: str   # checkpoint tensor (or module) that is broken
    module: str   # the vLLM module whose load must fail and be named in the error
    problem: str  # words the loader's error must contain


MALFORMED: dict[str, Malformed] = {
    m.kind: m
    for m in (
        # A missing shard scale of a fused FP8 projection: the fused parameter still receives
        # the q and v scales, so only a per-shard check can notice the hole.
        Malformed("missing-scale", "model.language_model.layers.3.self_attn.k_proj.weight_scale",
                  "model.layers.3.self_attn.qkv_proj", "missing"),
        Malformed("wrong-scale-shape", "model.language_model.layers.0.mlp.down_proj.weight_scale",
                  "model.layers.0.mlp.down_proj", "shape"),
        Malformed("nan-scale", "model.language_model.layers.1.mlp.up_proj.weight_scale_2",
                  "model.layers.1.mlp.gate_up_proj", "NaN"),
        Malformed("inf-scale", "model.language_model.layers.4.linear_attn.out_proj.weight_scale",
                  "model.layers.4.linear_attn.out_proj", "inf"),
        Malformed("unknown-algo", "model.language_model.layers.2.mlp.down_proj",
                  "model.layers.2.mlp.down_proj", "NVFP3"),
        Malformed("k-not-multiple", "model.language_model.layers.0.mlp.down_proj.weight",
                  "model.layers.0.mlp.down_proj", "multiple of 16"),
    )
}


# ----------------------------------------------------------------------------------- encoding
def encode_nvfp4_padded(w: torch.Tensor, global_amax: float | None = None):
    """NVFP4-encode ``w``; K that is not a multiple of 16 is zero-padded for the encoder and the
    codes and scales are cut back to ceil(K/2) bytes and ceil(K/16) groups (malformed case only).
    ``global_amax`` (shared by fused shards) sets weight_scale_2 = amax / (6 * 448)."""
    n, k = w.shape
    k_pad = -(-k // formats.NVFP4.group_size) * formats.NVFP4.group_size
    wp = torch.zeros(n, k_pad) if k_pad != k else w.float()
    if k_pad != k:
        wp[:, :k] = w
    if global_amax is not None:
        # Put the shared amax in a spare row so the encoder derives weight_scale_2 from it,
        # then drop the row: the codes of the real rows depend only on that global scale.
        aug = torch.zeros(n + 1, k_pad)
        aug[:n] = wp
        aug[n, 0] = global_amax
        q, s, s2 = nvfp4_codec.quantize(aug)
        q, s = q[:n], s[:n]
    else:
        q, s, s2 = nvfp4_codec.quantize(wp)
    if k_pad != k:
        q, s = q[:, : -(-k // 2)], s[:, : -(-k // formats.NVFP4.group_size)]
    return q.contiguous(), s.contiguous(), s2


def shared_global_amax(weights: dict[str, torch.Tensor]) -> dict[str, float]:
    out = {}
    for group in tiny_hybrid.NVFP4_SHARED_GLOBAL:
        for key in weights:
            if key.endswith(f"{group[0]}.weight"):
                base = key[: -len(f"{group[0]}.weight")]
                names = [f"{base}{g}" for g in group]
                amax = max(float(weights[f"{m}.weight"].abs().max()) for m in names)
                out.update({m: amax for m in names})
    return out


# -------------------------------------------------------------------------------- calibration
def calibrate(spec, weights: dict[str, torch.Tensor], modules: list[str],
              token_ids: list[int]) -> tuple[dict[str, float], dict[str, float]]:
    """Max calibration of the float model over ``token_ids``, as ModelOpt's ``max`` algorithm
    does it: (largest |input| of each quantized linear, largest |K| / |V| entering attention
    per full-attention layer, keyed 'model.layers.N.self_attn.k' / '.v'). K is taken after
    RoPE, where the attention reads (and a KV cache stores) it."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    from transformers.models.qwen3_5 import modeling_qwen3_5

    cfg_dict = spec.config_dict(eos_token_id=0, pad_token_id=0)
    cfg_dict = {k: v for k, v in cfg_dict.items() if k not in ("architectures", "model_type", "dtype")}
    config = Qwen3_5TextConfig(**cfg_dict)
    model = Qwen3_5ForCausalLM(config).float().eval()
    state = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"float model and weights disagree: missing {missing}, unexpected {unexpected}")
    amax: dict[str, float] = {}
    kv_amax: dict[str, float] = {}
    hooks = []
    named = dict(model.named_modules())

    for name in modules:
        hooks.append(named[name].register_forward_pre_hook(
            lambda mod, args, name=name: keep_max(amax, name, args[0])))
    run_recording_kv(model, spec, modeling_qwen3_5, token_ids, hooks, kv_amax)
    return amax, kv_amax


def keep_max(table: dict[str, float], key: str, t: torch.Tensor) -> None:
    if t.numel():
        table[key] = max(table.get(key, 0.0), float(t.detach().abs().max()))


def run_recording_kv(model, spec, modeling_module, token_ids: list[int], hooks: list,
                     kv_amax: dict[str, float]) -> None:
    """Run the float model once over ``token_ids`` with the largest |K| (after RoPE, where
    attention reads it) and |V| of every full-attention layer recorded into ``kv_amax``; then
    remove every hook in ``hooks`` and the RoPE wrapper."""
    named = dict(model.named_modules())
    attn_layers = [i for i, t in enumerate(spec.layer_types()) if t == "full_attention"]
    for i in attn_layers:
        hooks.append(named[f"model.layers.{i}.self_attn.v_proj"].register_forward_hook(
            lambda mod, args, out, i=i: keep_max(kv_amax, f"model.layers.{i}.self_attn.v", out)))
    calls = iter(attn_layers)
    rope = modeling_module.apply_rotary_pos_emb

    def rope_and_record(q, k, *args, **kwargs):
        q, k = rope(q, k, *args, **kwargs)
        keep_max(kv_amax, f"model.layers.{next(calls)}.self_attn.k", k)
        return q, k

    modeling_module.apply_rotary_pos_emb = rope_and_record
    try:
        with torch.no_grad():
            model(torch.tensor([token_ids]))
    finally:
        modeling_module.apply_rotary_pos_emb = rope
        for h in hooks:
            h.remove()


def hub_name(name: str) -> str:
    """Checkpoint name as ModelOpt 0.47 writes it for this family: the trunk under
    ``model.language_model.`` (the hub layout of Qwen3.5 checkpoints), ``lm_head`` and ``mtp.*``
    as they are. vLLM's Qwen3_5ForCausalLM maps the prefix back to ``model.``."""
    return "model.language_model." + name[len("model."):] if name.startswith("model.") else name


# ------------------------------------------------------------------------------------- export
def _quant_entry(region: str) -> dict:
    """ModelOpt's quantized_layers entry: the format's ModelOpt algo, and its group size if any."""
    fmt = formats.weight_format(region)
    entry = {"quant_algo": fmt.algos[0]}
    if fmt.group_size is not None:
        entry["group_size"] = fmt.group_size
    return entry


def hf_quant_config(quantized: dict[str, str]) -> dict:
    """hf_quant_config.json content in ModelOpt's layout (``quantized_layers`` lists every
    quantized module by checkpoint name, so ModelOpt writes no ``exclude_modules``)."""
    return {
        "producer": {"name": "modelopt", "version": MODELOPT_VERSION_FORM},
        "quantization": {
            "quant_algo": "MIXED_PRECISION",
            "kv_cache_quant_algo": "FP8",
            "quantized_layers": {hub_name(name): _quant_entry(r) for name, r in sorted(quantized.items())},
        },
    }


def embedded_quantization_config(hf_quant: dict) -> dict:
    """The config.json ``quantization_config`` newer ModelOpt releases write beside the file."""
    q = hf_quant["quantization"]
    groups: dict[tuple, list[str]] = {}
    for name, entry in q["quantized_layers"].items():
        groups.setdefault(tuple(sorted(entry.items())), []).append(name)
    config_groups = {}
    for i, (key, names) in enumerate(groups.items()):
        entry = dict(key)
        if entry["quant_algo"] == "FP8":
            g = {"input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
                 "weights": {"dynamic": False, "num_bits": 8, "type": "float"}}
        else:
            gs = entry.get("group_size", 16)
            g = {"input_activations": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": gs},
                 "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": gs}}
        g["targets"] = sorted(names)
        config_groups[f"group_{i}"] = g
    return {
        "config_groups": config_groups,
        "quantized_layers": q["quantized_layers"],
        "ignore": q.get("exclude_modules", []),
        "quant_algo": q["quant_algo"],
        "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"},
        "producer": hf_quant["producer"],
        "quant_method": "modelopt",
    }


def export_tensors(weights: dict[str, torch.Tensor], quantized: dict[str, str],
                   input_amax: dict[str, float], kv_amax: dict[str, float],
                   shared: dict[str, float] | None = None) -> dict[str, torch.Tensor]:
    """Checkpoint tensors under hub names: quantized modules encoded, the rest in BF16, and
    the FP8 KV-cache scales (amax / 448) ModelOpt writes as ``k_proj.k_scale`` / ``v_proj.v_scale``.
    ``shared``: {module: NVFP4 global amax shared with its fused siblings} (default: this
    model's fused groups, tiny_hybrid.NVFP4_SHARED_GLOBAL)."""
    shared = shared_global_amax(weights) if shared is None else shared
    out: dict[str, torch.Tensor] = {}
    for key, w in weights.items():
        module = key[: -len(".weight")] if key.endswith(".weight") else None
        region = quantized.get(module) if module else None
        if region is None:
            out[hub_name(key)] = w.to(torch.bfloat16).contiguous()
            continue
        a = input_amax[module]
        m = hub_name(module)
        fmt = formats.weight_format(region)
        if not fmt.has_group_scales:  # FP8 per tensor
            q, s = families.numerics(fmt).quantize(w)
            out[f"{m}.weight"] = q
            out[f"{m}.weight_scale"] = s.reshape(())
            out[f"{m}.input_scale"] = torch.tensor(a / formats.E4M3_MAX, dtype=torch.float32)
        else:
            q, s, s2 = encode_nvfp4_padded(w, shared.get(module))
            out[f"{m}.weight"] = q
            out[f"{m}.weight_scale"] = s
            out[f"{m}.weight_scale_2"] = s2.reshape(()).float()
            out[f"{m}.input_scale"] = torch.tensor(
                a / (formats.E2M1_MAX * formats.E4M3_MAX), dtype=torch.float32)
    for key, a in kv_amax.items():
        attn, which = key.rsplit(".", 1)
        out[hub_name(f"{attn}.{which}_proj.{which}_scale")] = torch.tensor(a / formats.E4M3_MAX, dtype=torch.float32)
    return out


def _break(kind: str, tensors: dict[str, torch.Tensor], hf_quant: dict) -> None:
    m = MALFORMED[kind]
    if kind == "missing-scale":
        del tensors[m.tensor]
    elif kind == "wrong-scale-shape":
        s = tensors[m.tensor]
        tensors[m.tensor] = s[:, : s.shape[1] // 2].contiguous()  # one scale per 32 inputs
    elif kind == "nan-scale":
        tensors[m.tensor] = torch.tensor(float("nan"), dtype=torch.float32)
    elif kind == "inf-scale":
        tensors[m.tensor] = torch.tensor(float("inf"), dtype=torch.float32)
    elif kind == "unknown-algo":
        hf_quant["quantization"]["quantized_layers"][m.tensor] = {"quant_algo": "NVFP3", "group_size": 16}
    elif kind == "k-not-multiple":
        pass  # made through the spec (intermediate_size), see make_checkpoint
    else:
        raise ValueError(f"unknown malformed kind {kind!r}; choose from {sorted(MALFORMED)}")



@contextlib.contextmanager
def checkpoint_folder(out: Path):
    """Yield a private sibling folder to write a checkpoint into; when the block succeeds it becomes
    ``out`` in one rename (readers never see half a checkpoint), and on any failure it is removed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        yield tmp
        # mkdtemp makes the folder private; a checkpoint is ordinary readable data.
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

def make_checkpoint(out_dir: str | os.PathLike, seed: int = 0, malformed: str | None = None,
                    embed_config: bool = False, spec: tiny_hybrid.TinyHybridSpec | None = None,
                    embed_layers: bool = True) -> dict:
    """Write the checkpoint to ``out_dir`` (which must not exist); returns a summary dict.
    ``embed_layers=False`` (with ``embed_config``) leaves ``quantized_layers`` out of config.json."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    if out.exists():
        raise FileExistsError(f"{out} exists; pass a new folder (the generator never overwrites)")
    if malformed is not None and malformed not in MALFORMED:
        raise ValueError(f"unknown --malformed kind {malformed!r}; choose from {sorted(MALFORMED)}")
    spec = spec or tiny_hybrid.TinyHybridSpec()
    if malformed == "k-not-multiple":
        spec = replace(spec, intermediate_size=200)
    with checkpoint_folder(out) as tmp:
        ids = tiny_tokenizer.write_tokenizer(tmp, spec.vocab_size, spec.max_position_embeddings)
        weights = tiny_hybrid.float_weights(spec, seed)
        quantized = tiny_hybrid.quantized_modules(weights)
        from tokenizers import Tokenizer

        calib_ids = Tokenizer.from_file(str(tmp / "tokenizer.json")).encode(
            " ".join(tiny_tokenizer.CORPUS)).ids[:256]
        input_amax, kv_amax = calibrate(spec, weights, sorted(quantized), calib_ids)
        tensors = export_tensors(weights, quantized, input_amax, kv_amax)
        hf_quant = hf_quant_config(quantized)
        if malformed:
            _break(malformed, tensors, hf_quant)

        config = spec.config_dict(eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
        if embed_config:
            config["quantization_config"] = embedded_quantization_config(hf_quant)
            if not embed_layers:
                del config["quantization_config"]["quantized_layers"]
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=4) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps({
            "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
            "pad_token_id": ids["<|endoftext|>"],
            "do_sample": False,
        }, indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        summary = {
            "out_dir": str(out),
            "seed": seed,
            "malformed": malformed,
            "embed_config": embed_config,
            "embed_layers": embed_config and embed_layers,
            "architecture": "Qwen3_5ForCausalLM",
            "layer_types": spec.layer_types(),
            "quantized_modules": {r: sum(1 for v in quantized.values() if v == r) for r in ("fp8", "nvfp4")},
            "tensors": len(tensors),
            "bytes": (tmp / "model.safetensors").stat().st_size,
        }
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qpn.scripts.checkpoints.make_checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", help="folder to create (must not exist)")
    p.add_argument("--seed", type=int, default=0, help="seed of the float weights (default 0)")
    p.add_argument("--malformed", choices=sorted(MALFORMED), default=None,
                   help="write a broken variant for the loader's error tests")
    p.add_argument("--embed-config", action="store_true",
                   help="also embed quantization_config in config.json, as ModelOpt >= 0.31 does")
    p.add_argument("--embed-without-layers", action="store_true",
                   help="embed quantization_config without its quantized_layers map (kept only in "
                        "hf_quant_config.json)")
    args = p.parse_args(argv)
    try:
        summary = make_checkpoint(args.out_dir, seed=args.seed, malformed=args.malformed,
                                  embed_config=args.embed_config or args.embed_without_layers,
                                  embed_layers=not args.embed_without_layers)
    except (FileExistsError, ValueError) as e:
        print(f"make_checkpoint: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
