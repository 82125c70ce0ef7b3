"""Write a small ModelOpt-format MIXED_PRECISION checkpoint of the Qwen3.5 MoE family
(``Qwen3_5MoeForCausalLM``): the dense generator's hybrid trunk (qpn.scripts.checkpoints.make_checkpoint,
tiny_hybrid: gated-delta-net and full-attention layers 3:1, FP8 attention projections, NVFP4
lm_head, local tokenizer, FP8 KV scales) with a sparse MoE block in every layer: a router
(``mlp.gate``, BF16), E routed experts with top-k routing (``mlp.experts.{e}.gate_proj/up_proj/
down_proj``, NVFP4 by default or FP8), and one shared expert (``mlp.shared_expert.*``, NVFP4)
with its sigmoid gate (``mlp.shared_expert_gate``, BF16), as in the real Qwen3.5/3.6-35B-A3B.

    python -m qpn.scripts.checkpoints.make_moe_checkpoint OUT_DIR [--seed S] [--expert-format nvfp4|fp8] [--embed-config]

Encodings as ModelOpt exports them: per expert, gate and up share one NVFP4 global scale (the
export unifies the amax of linears reading the same input; vLLM's own NVFP4 MoE path assumes
it), down has its own; activation scales from a max-calibration pass of the float model in
transformers (per expert over the tokens routed to it; an expert no calibration token reaches
gets the amax of its layer's MoE input, a documented stand-in: QPN serves W4A16 and never reads
activation scales). The MTP head (``mtp.*``) has the same MoE block, in BF16.

``load_reference_model(ckpt_dir)`` loads the checkpoint dequantized in float32 into transformers'
own ``Qwen3_5MoeForCausalLM`` through qpn.scripts.checkpoints.checkpoint_reference (the decoders shared with
the dense end-to-end test: compressed-tensors for NVFP4, torch for e4m3), fusing the per-expert
tensors into transformers' [E, 2I, H] / [E, H, I] expert parameters.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from qpn.kernels import formats
from qpn.scripts.checkpoints import make_checkpoint, tiny_hybrid, tiny_tokenizer
from qpn.scripts.checkpoints.make_checkpoint import keep_max

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class TinyMoeSpec(tiny_hybrid.TinyHybridSpec):
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    shared_expert_intermediate_size: int = 128
    router_gain: float = 3.0   # router logit spread
    # lm_head gain 2 (the dense generator uses 4) and routed-expert down gain 0.5: a top-k
    # boundary that BF16 rounding moves (the CPU engine serves BF16) flips an expert, and with
    # 4x-peaked logits and strong experts, BF16 vs float32 of the same float model (transformers)
    # differed by 0.40 nat on average, 2.9 at worst, over 64 positions; with these gains 0.084 /
    # 0.50 over the 95 positions of tests/test_e2e_moe.py (measured 2026-11-29).
    lm_head_gain: float = 2.0
    expert_down_gain: float = 0.5

    def config_dict(self, eos_token_id: int, pad_token_id: int) -> dict:
        cfg = super().config_dict(eos_token_id, pad_token_id)
        cfg.pop("intermediate_size", None)
        cfg.update(
            architectures=["Qwen3_5MoeForCausalLM"],
            model_type="qwen3_5_moe_text",
            num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            moe_intermediate_size=self.moe_intermediate_size,
            shared_expert_intermediate_size=self.shared_expert_intermediate_size,
            norm_topk_prob=True,
            router_aux_loss_coef=0.001,
            output_router_logits=False,
        )
        return cfg


def _moe_block(spec: TinyMoeSpec, gen: torch.Generator, prefix: str) -> dict[str, torch.Tensor]:
    h, i, s = spec.hidden_size, spec.moe_intermediate_size, spec.shared_expert_intermediate_size
    lin = tiny_hybrid._linear
    w = {f"{prefix}.gate.weight": lin(gen, spec.num_experts, h, spec.router_gain)}
    for e in range(spec.num_experts):
        # experts differ in gain, so that which expert a token reaches matters to the output
        g = 0.6 + 0.8 * e / max(1, spec.num_experts - 1)
        w[f"{prefix}.experts.{e}.gate_proj.weight"] = lin(gen, i, h, g)
        w[f"{prefix}.experts.{e}.up_proj.weight"] = lin(gen, i, h, 1.0)
        w[f"{prefix}.experts.{e}.down_proj.weight"] = lin(gen, h, i, spec.expert_down_gain)
    w[f"{prefix}.shared_expert.gate_proj.weight"] = lin(gen, s, h, 1.0)
    w[f"{prefix}.shared_expert.up_proj.weight"] = lin(gen, s, h, 1.0)
    w[f"{prefix}.shared_expert.down_proj.weight"] = lin(gen, h, s, 1.0)
    w[f"{prefix}.shared_expert_gate.weight"] = lin(gen, 1, h, 1.0)
    return w


def float_weights(spec: TinyMoeSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """float32 master weights under checkpoint names: the dense generator's trunk with every
    dense MLP replaced by the MoE block (experts drawn from their own seeded stream)."""
    base = tiny_hybrid.float_weights(spec, seed)
    out = {k: v for k, v in base.items() if ".mlp." not in k}
    gen = torch.Generator().manual_seed(int(seed) + 7919)
    layers = [f"model.layers.{n}" for n in range(spec.num_hidden_layers)] + \
             [f"mtp.layers.{j}" for j in range(spec.mtp_num_hidden_layers)]
    for layer in layers:
        out.update(_moe_block(spec, gen, f"{layer}.mlp"))
    out["lm_head.weight"] = tiny_hybrid._linear(gen, spec.vocab_size, spec.hidden_size, spec.lm_head_gain)
    return out


def quantized_modules(weights: dict[str, torch.Tensor], expert_format: str = "nvfp4") -> dict[str, str]:
    """The dense plan (FP8 attention, NVFP4 lm_head) plus the MoE plan: routed experts in
    ``expert_format``, the shared expert in NVFP4, router and shared-expert gate in BF16."""
    out = tiny_hybrid.quantized_modules(weights)
    for key, t in weights.items():
        if not key.endswith(".weight") or t.dim() != 2 or key.startswith("mtp."):
            continue
        module = key[: -len(".weight")]
        if ".mlp.experts." in module and module.endswith(EXPERT_PROJS):
            out[module] = expert_format
        elif ".mlp.shared_expert." in module and module.endswith(EXPERT_PROJS):
            out[module] = "nvfp4"
    return out


def shared_global_amax(weights: dict[str, torch.Tensor], quantized: dict[str, str]) -> dict[str, float]:
    """gate and up of each expert (and of the shared expert) share one NVFP4 global amax."""
    out: dict[str, float] = {}
    for module, region in quantized.items():
        if region == "nvfp4" and module.endswith(".gate_proj"):
            base = module[: -len("gate_proj")]
            pair = [f"{base}gate_proj", f"{base}up_proj"]
            amax = max(float(weights[f"{m}.weight"].abs().max()) for m in pair)
            out.update({m: amax for m in pair})
    return out


def transformers_state(weights: dict[str, torch.Tensor], spec: TinyMoeSpec) -> dict[str, torch.Tensor]:
    """Checkpoint-named per-expert weights -> transformers' Qwen3_5MoeForCausalLM state dict
    (experts fused to gate_up_proj [E, 2I, H] and down_proj [E, H, I]); mtp.* dropped."""
    out = {k: v for k, v in weights.items() if not k.startswith("mtp.") and ".mlp.experts." not in k}
    for n in range(spec.num_hidden_layers):
        p = f"model.layers.{n}.mlp.experts"
        out[f"{p}.gate_up_proj"] = torch.stack([
            torch.cat([weights[f"{p}.{e}.gate_proj.weight"], weights[f"{p}.{e}.up_proj.weight"]])
            for e in range(spec.num_experts)])
        out[f"{p}.down_proj"] = torch.stack([weights[f"{p}.{e}.down_proj.weight"] for e in range(spec.num_experts)])
    return out


def _transformers_model(config_dict: dict, state: dict[str, torch.Tensor]):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    cfg = {k: v for k, v in config_dict.items()
           if k not in ("architectures", "model_type", "dtype", "quantization_config", "transformers_version")}
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**cfg)).float().eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"transformers model and weights disagree: missing {missing}, unexpected {unexpected}")
    return model


def calibrate(spec: TinyMoeSpec, weights: dict[str, torch.Tensor], quantized: dict[str, str],
              token_ids: list[int]) -> tuple[dict[str, float], dict[str, float]]:
    """Max calibration of the float model (transformers, float32) over ``token_ids``: the
    largest |input| of every quantized module (experts: over the tokens routed to them) and the
    largest |K| (after RoPE) / |V| of every full-attention layer."""
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as mm

    model = _transformers_model(spec.config_dict(0, 0), transformers_state(weights, spec))
    named = dict(model.named_modules())
    amax: dict[str, float] = {}
    kv_amax: dict[str, float] = {}
    hooks = []

    for name in quantized:
        if ".mlp.experts." not in name:
            hooks.append(named[name].register_forward_pre_hook(
                lambda mod, args, name=name: keep_max(amax, name, args[0])))
    block_amax: dict[str, float] = {}
    for n in range(spec.num_hidden_layers):
        p = f"model.layers.{n}.mlp.experts"

        def expert_inputs(mod, args, p=p):
            hidden, top_idx = args[0], args[1]
            keep_max(block_amax, p, hidden)
            for e in range(spec.num_experts):
                rows = (top_idx == e).any(dim=-1)
                if not bool(rows.any()):
                    continue
                x = hidden[rows]
                gate, up = torch.nn.functional.linear(x, mod.gate_up_proj[e]).chunk(2, dim=-1)
                keep_max(amax, f"{p}.{e}.gate_proj", x)
                keep_max(amax, f"{p}.{e}.up_proj", x)
                keep_max(amax, f"{p}.{e}.down_proj", torch.nn.functional.silu(gate) * up)

        hooks.append(named[p].register_forward_pre_hook(expert_inputs))
    make_checkpoint.run_recording_kv(model, spec, mm, token_ids, hooks, kv_amax)
    for name in quantized:  # experts no calibration token reached: the layer's MoE input amax
        if name not in amax:
            amax[name] = block_amax[name.split(".experts.")[0] + ".experts"]
    return amax, kv_amax


def export_tensors(weights: dict[str, torch.Tensor], quantized: dict[str, str], input_amax: dict[str, float],
                   kv_amax: dict[str, float]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors under hub names: make_checkpoint's export, with gate and up of each
    expert sharing one NVFP4 global amax."""
    return make_checkpoint.export_tensors(weights, quantized, input_amax, kv_amax,
                                          shared=shared_global_amax(weights, quantized))


def make_moe_checkpoint(out_dir: str | os.PathLike, seed: int = 0, expert_format: str = "nvfp4",
                        embed_config: bool = False, spec: TinyMoeSpec | None = None) -> dict:
    """Write the checkpoint to ``out_dir`` (which must not exist); returns a summary dict."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer

    out = Path(out_dir)
    if out.exists():
        raise FileExistsError(f"{out} exists; pass a new folder (the generator never overwrites)")
    if expert_format not in formats.FAMILIES:
        raise ValueError(f"--expert-format must be nvfp4 or fp8, got {expert_format!r}")
    spec = spec or TinyMoeSpec()
    with make_checkpoint.checkpoint_folder(out) as tmp:
        ids = tiny_tokenizer.write_tokenizer(tmp, spec.vocab_size, spec.max_position_embeddings)
        weights = float_weights(spec, seed)
        quantized = quantized_modules(weights, expert_format)
        calib_ids = Tokenizer.from_file(str(tmp / "tokenizer.json")).encode(
            " ".join(tiny_tokenizer.CORPUS)).ids[:256]
        input_amax, kv_amax = calibrate(spec, weights, quantized, calib_ids)
        tensors = export_tensors(weights, quantized, input_amax, kv_amax)
        hf_quant = make_checkpoint.hf_quant_config(quantized)
        config = spec.config_dict(eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
        if embed_config:
            config["quantization_config"] = make_checkpoint.embedded_quantization_config(hf_quant)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=4) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps({
            "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
            "pad_token_id": ids["<|endoftext|>"], "do_sample": False}, indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        counts: dict[str, int] = {}
        for module, region in quantized.items():
            kind = "routed_expert" if ".experts." in module else "shared_expert" if ".shared_expert." in module \
                else "dense"
            counts[f"{kind}_{region}"] = counts.get(f"{kind}_{region}", 0) + 1
        summary = {
            "out_dir": str(out), "seed": seed, "expert_format": expert_format, "embed_config": embed_config,
            "architecture": "Qwen3_5MoeForCausalLM", "layer_types": spec.layer_types(),
            "num_experts": spec.num_experts, "top_k": spec.num_experts_per_tok,
            "moe_intermediate_size": spec.moe_intermediate_size,
            "shared_expert_intermediate_size": spec.shared_expert_intermediate_size,
            "quantized_modules": counts, "tensors": len(tensors),
            "bytes": (tmp / "model.safetensors").stat().st_size,
        }
    return summary


# Negative controls of the MoE end-to-end test: what a wrong expert path would compute.
MOE_PERTURBATIONS = ("none", "swap-gate-up", "shift-experts", "drop-shared-expert")
# One expert of one layer served wrongly (what a per-expert loading or indexing bug does):
# expert e given expert e+1's weights; its gate and up exchanged; its codes decoded with expert
# e+1's scales; its NVFP4 nibbles exchanged (NVFP4 experts only).
EXPERT_CORRUPTIONS = ("neighbour-weights", "swap-gate-up", "neighbour-scales", "swap-nibbles")


def _corrupt_one_expert(state: dict[str, torch.Tensor], ckpt_dir: str | os.PathLike, layer: int, expert: int,
                        kind: str, num_experts: int) -> None:
    """Replace expert ``expert`` of layer ``layer`` in the float32 state (checkpoint names, model.*)
    by what ``kind`` of bug would serve; decoded from the checkpoint's own codes and scales."""
    from safetensors.torch import load_file

    from qpn.scripts.checkpoints import checkpoint_reference

    if kind not in EXPERT_CORRUPTIONS:
        raise ValueError(f"unknown expert corruption {kind!r}; choose from {EXPERT_CORRUPTIONS}")
    here, there = (f"model.layers.{layer}.mlp.experts.{e}" for e in (expert, (expert + 1) % num_experts))
    if kind == "neighbour-weights":
        for proj in EXPERT_PROJS:
            state[f"{here}.{proj}.weight"] = state[f"{there}.{proj}.weight"].clone()
        return
    if kind == "swap-gate-up":
        g, u = f"{here}.gate_proj.weight", f"{here}.up_proj.weight"
        state[g], state[u] = state[u], state[g]
        return
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(Path(ckpt_dir).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    from qpn.fork_patches.quant.conventions import COMPRESSED_TENSORS, detect

    ct = detect(ckpt_dir)[0] is COMPRESSED_TENSORS
    hub = make_checkpoint.hub_name
    for proj in EXPERT_PROJS:
        mine, theirs = hub(f"{here}.{proj}"), hub(f"{there}.{proj}")
        scales_of = theirs if kind == "neighbour-scales" else mine
        if ct:
            w = _ct_expert_decode(tensors, mine, scales_of, kind)
        elif f"{mine}.weight_scale_2" in tensors:  # NVFP4
            w = checkpoint_reference.decode_nvfp4(tensors[f"{mine}.weight"], tensors[f"{scales_of}.weight_scale"],
                                                  tensors[f"{scales_of}.weight_scale_2"],
                                                  swap_nibbles=(kind == "swap-nibbles"))
        elif kind == "swap-nibbles":
            raise ValueError("swap-nibbles corrupts NVFP4 codes; these experts are FP8")
        else:
            w = checkpoint_reference.decode_fp8(tensors[f"{mine}.weight"], tensors[f"{scales_of}.weight_scale"])
        state[f"{here}.{proj}.weight"] = w


def _ct_expert_decode(tensors: dict[str, torch.Tensor], mine: str, scales_of: str, kind: str) -> torch.Tensor:
    """A compressed-tensors expert's float32 weight by the library's own decode: its codes with
    the scales of ``scales_of``, its nibbles exchanged for ``swap-nibbles``."""
    from qpn.scripts.checkpoints import ct_reference

    if f"{mine}.weight_packed" in tensors:
        t = {f"{mine}.weight_packed": tensors[f"{mine}.weight_packed"],
             f"{mine}.weight_scale": tensors[f"{scales_of}.weight_scale"],
             f"{mine}.weight_global_scale": tensors[f"{scales_of}.weight_global_scale"]}
        return ct_reference._decode_nvfp4(t, mine, "swap-nibbles" if kind == "swap-nibbles" else "none")
    if kind == "swap-nibbles":
        raise ValueError("swap-nibbles corrupts NVFP4 codes; these experts are FP8")
    return ct_reference._decode_fp8(tensors, mine, tensors[f"{scales_of}.weight_scale"])


def load_reference_model(ckpt_dir: str | os.PathLike, perturb: str = "none", moe_perturb: str = "none",
                         corrupt_expert: tuple[int, int, str] | None = None):
    """The checkpoint dequantized in float32 (qpn.scripts.checkpoints.checkpoint_reference's decoders) in
    transformers' Qwen3_5MoeForCausalLM. ``perturb``: checkpoint_reference's perturbations;
    ``moe_perturb``: gate and up exchanged in every expert, expert e given expert e+1's weights,
    or the shared expert removed; ``corrupt_expert=(layer, expert, kind)``: one expert of one
    layer served wrongly (EXPERT_CORRUPTIONS). All are negative controls a tolerance must reject.
    A compressed-tensors checkpoint (make_ct_checkpoint --moe) is decoded by the library's own
    code (qpn.scripts.checkpoints.ct_reference; ``perturb`` then names ct_reference's
    perturbations)."""
    from qpn.fork_patches.quant.conventions import COMPRESSED_TENSORS, detect
    from qpn.scripts.checkpoints import checkpoint_reference, ct_reference

    if moe_perturb not in MOE_PERTURBATIONS:
        raise ValueError(f"unknown MoE perturbation {moe_perturb!r}; choose from {MOE_PERTURBATIONS}")
    config = json.loads((Path(ckpt_dir) / "config.json").read_text())
    e_count = config["num_experts"]
    spec_like = TinyMoeSpec(num_experts=e_count, num_hidden_layers=config["num_hidden_layers"])
    decoder = ct_reference if detect(ckpt_dir)[0] is COMPRESSED_TENSORS else checkpoint_reference
    state = decoder.dequantized_state_dict(ckpt_dir, perturb)
    if moe_perturb == "swap-gate-up":
        for k in [k for k in state if ".mlp.experts." in k and k.endswith("gate_proj.weight")]:
            u = k.replace("gate_proj", "up_proj")
            state[k], state[u] = state[u], state[k]
    elif moe_perturb == "shift-experts":
        orig = dict(state)
        for k in orig:
            if ".mlp.experts." in k:
                head, rest = k.split(".mlp.experts.")
                e, tail = rest.split(".", 1)
                state[k] = orig[f"{head}.mlp.experts.{(int(e) + 1) % e_count}.{tail}"]
    elif moe_perturb == "drop-shared-expert":
        for k in [k for k in state if k.endswith("shared_expert.down_proj.weight")]:
            state[k] = torch.zeros_like(state[k])
    if corrupt_expert is not None:
        layer, expert, kind = corrupt_expert
        _corrupt_one_expert(state, ckpt_dir, layer, expert, kind, e_count)
    return _transformers_model(config, transformers_state(state, spec_like))


def expert_use(model, token_ids: list[int], layer: int) -> list[int]:
    """How many of the (position, slot) picks of ``layer``'s router go to each expert when the
    model reads ``token_ids`` (every position but the last: the teacher-forced ones)."""
    picks = []
    hook = model.model.layers[layer].mlp.gate.register_forward_hook(
        lambda mod, args, out: picks.append(out[2][:-1].reshape(-1).clone()))
    try:
        with torch.no_grad():
            model(torch.tensor([token_ids]))
    finally:
        hook.remove()
    return torch.bincount(picks[0], minlength=model.config.num_experts).tolist()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qpn.scripts.checkpoints.make_moe_checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", help="folder to create (must not exist)")
    p.add_argument("--seed", type=int, default=0, help="seed of the float weights (default 0)")
    p.add_argument("--expert-format", choices=tuple(formats.FAMILIES), default="nvfp4",
                   help="encoding of the routed experts (default nvfp4; the shared expert stays NVFP4)")
    p.add_argument("--embed-config", action="store_true",
                   help="also embed quantization_config in config.json, as ModelOpt >= 0.31 does")
    args = p.parse_args(argv)
    try:
        summary = make_moe_checkpoint(args.out_dir, seed=args.seed, expert_format=args.expert_format,
                                      embed_config=args.embed_config)
    except (FileExistsError, ValueError) as e:
        print(f"make_moe_checkpoint: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
