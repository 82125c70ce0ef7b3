"""Export the tiny hybrid model with NVIDIA ModelOpt itself, for the generator's cross-check.

    python -m qpn.scripts.checkpoints.modelopt_export OUT_DIR [--seed S]

Runs in a Python that has ``nvidia-modelopt`` (0.47) and ``transformers``; it needs neither vLLM
nor a GPU. It builds transformers' ``Qwen3_5ForCausalLM`` with the generator's float weights
(qpn.scripts.checkpoints.tiny_hybrid, same seed), quantizes it with ModelOpt's own ``mtq.quantize`` (max
calibration over the generator's calibration text) using the generator's precision plan (FP8
attention projections, NVFP4 MLP and lm_head, FP8 KV), and writes the checkpoint with ModelOpt's
``export_hf_checkpoint``. A test then loads both checkpoints and compares codes and scales.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from qpn.scripts.checkpoints import tiny_hybrid, tiny_tokenizer

_NVFP4 = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}
_FP8 = {"num_bits": (4, 3), "axis": None}


def quant_cfg() -> dict:
    entries = [{"quantizer_name": "*", "enable": False}]
    for suffix in tiny_hybrid.FP8_SUFFIXES:
        for q in ("weight_quantizer", "input_quantizer"):
            entries.append({"quantizer_name": f"*layers.*.{suffix}.{q}", "cfg": dict(_FP8)})
    for suffix in tiny_hybrid.NVFP4_SUFFIXES:
        for q in ("weight_quantizer", "input_quantizer"):
            entries.append({"quantizer_name": f"*layers.*.{suffix}.{q}", "cfg": dict(_NVFP4)})
    for q in ("weight_quantizer", "input_quantizer"):
        entries.append({"quantizer_name": f"lm_head.{q}", "cfg": dict(_NVFP4)})
    for q in ("k_bmm_quantizer", "v_bmm_quantizer"):
        entries.append({"quantizer_name": f"*{q}", "cfg": dict(_FP8)})
    return {"quant_cfg": entries, "algorithm": "max"}


def export(out_dir: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from tokenizers import Tokenizer
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    spec = tiny_hybrid.TinyHybridSpec()
    weights = tiny_hybrid.float_weights(spec, seed)
    cfg = spec.config_dict(eos_token_id=0, pad_token_id=0)
    cfg = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "dtype")}
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**cfg)).float().eval()
    model.config.architectures = ["Qwen3_5ForCausalLM"]  # ModelOpt's export reads it
    missing, unexpected = model.load_state_dict(
        {k: v for k, v in weights.items() if not k.startswith("mtp.")}, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"weights do not fit the model: missing {missing}, unexpected {unexpected}")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=False)
    tiny_tokenizer.write_tokenizer(out, spec.vocab_size, spec.max_position_embeddings)
    ids = Tokenizer.from_file(str(out / "tokenizer.json")).encode(" ".join(tiny_tokenizer.CORPUS)).ids[:256]

    def forward_loop(m):
        with torch.no_grad():
            m(torch.tensor([ids]))

    model = mtq.quantize(model, quant_cfg(), forward_loop)
    export_hf_checkpoint(model, dtype=dtype, export_dir=str(out))
    hf_quant = json.loads((out / "hf_quant_config.json").read_text())
    return {"out_dir": str(out), "quant_algo": hf_quant["quantization"].get("quant_algo"),
            "quantized_layers": len(hf_quant["quantization"].get("quantized_layers", {}))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qpn.scripts.checkpoints.modelopt_export", description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="export dtype; ModelOpt also does its quantization arithmetic in it")
    args = p.parse_args(argv)
    print(json.dumps(export(args.out_dir, args.seed, getattr(torch, args.dtype))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
