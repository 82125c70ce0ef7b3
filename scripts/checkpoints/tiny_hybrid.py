"""A tiny model of the Qwen3.5/3.8 hybrid family, small enough for the vLLM CPU engine to boot
and answer in seconds: its configuration, its float weights (seeded), and the precision plan
that says which module a ModelOpt mixed export stores in FP8, in NVFP4, or leaves in BF16.

The shape follows the real model where it matters to the loader:

* ``Qwen3_5ForCausalLM`` (``model_type`` ``qwen3_5_text``): gated-delta-net (linear attention)
  and full-attention layers at 3:1, a gated MLP in every layer, an untied ``lm_head``, and a
  one-layer MTP head (``mtp.*``, kept in BF16 like the MTP weights of published NVFP4 exports).
* linear-attention head dims of 64: vLLM's CPU gated-delta-net kernel accepts 64 and 128 only.
* every K is a multiple of 16 (the NVFP4 group), every N a multiple of 8 (one QPN tile).

Names are the checkpoint's (HuggingFace) names: ``linear_attn.in_proj_qkv`` and ``in_proj_z``
(vLLM fuses them into ``in_proj_qkvz``), ``self_attn.q_proj/k_proj/v_proj`` (fused into
``qkv_proj``), ``mlp.gate_proj/up_proj`` (fused into ``gate_up_proj``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Precision plan, by the checkpoint's module names (suffix match inside a decoder layer).
FP8_SUFFIXES = (
    "linear_attn.in_proj_qkv",
    "linear_attn.in_proj_z",
    "linear_attn.out_proj",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
)
NVFP4_SUFFIXES = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
NVFP4_GROUP_SIZE = 16

# Fused projections whose NVFP4 shards share one global scale, as ModelOpt's export makes them
# (it unifies the weight amax of linears that read the same input). FP8 shards keep their own
# per-tensor scales here on purpose: the loader must serve per-shard scales as they are.
NVFP4_SHARED_GLOBAL = (("mlp.gate_proj", "mlp.up_proj"),)


@dataclass(frozen=True)
class TinyHybridSpec:
    vocab_size: int = 512           # a multiple of 64: no vocab padding rows in vLLM's lm_head
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 8      # 6 gated-delta-net + 2 full attention
    full_attention_interval: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64
    linear_conv_kernel_dim: int = 4
    mtp_num_hidden_layers: int = 1
    max_position_embeddings: int = 4096
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    rms_norm_eps: float = 1e-6

    def layer_types(self) -> list[str]:
        return [
            "full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
            for i in range(self.num_hidden_layers)
        ]

    def config_dict(self, eos_token_id: int, pad_token_id: int) -> dict:
        """config.json of the model (without any quantization section)."""
        return {
            "architectures": ["Qwen3_5ForCausalLM"],
            "model_type": "qwen3_5_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "layer_types": self.layer_types(),
            "full_attention_interval": self.full_attention_interval,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "attn_output_gate": True,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "mtp_num_hidden_layers": self.mtp_num_hidden_layers,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
            },
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": True,
            "eos_token_id": eos_token_id,
            "pad_token_id": pad_token_id,
            "dtype": "bfloat16",
        }


def region_of(name: str) -> str | None:
    """'fp8', 'nvfp4' or None (BF16) for a checkpoint module name (without '.weight')."""
    if name.startswith("mtp."):
        return None
    if name == "lm_head":
        return "nvfp4"
    if any(name.endswith(s) for s in FP8_SUFFIXES):
        return "fp8"
    if any(name.endswith(s) for s in NVFP4_SUFFIXES):
        return "nvfp4"
    return None


def _linear(gen: torch.Generator, n: int, k: int, gain: float = 1.0) -> torch.Tensor:
    return torch.randn(n, k, generator=gen) * (gain / math.sqrt(k))


def _layer_weights(spec: TinyHybridSpec, gen: torch.Generator, prefix: str, kind: str) -> dict:
    h = spec.hidden_size
    w: dict[str, torch.Tensor] = {}
    # Gemma-style RMSNorm weights (the model multiplies by 1 + w).
    w[f"{prefix}.input_layernorm.weight"] = 0.1 * torch.randn(h, generator=gen)
    w[f"{prefix}.post_attention_layernorm.weight"] = 0.1 * torch.randn(h, generator=gen)
    if kind == "linear_attention":
        kd = spec.linear_num_key_heads * spec.linear_key_head_dim
        vd = spec.linear_num_value_heads * spec.linear_value_head_dim
        a = f"{prefix}.linear_attn"
        # q, k and v get different gains so that the fused projection's shards differ in range.
        w[f"{a}.in_proj_qkv.weight"] = torch.cat(
            [_linear(gen, kd, h, 1.0), _linear(gen, kd, h, 0.6), _linear(gen, vd, h, 1.6)]
        )
        w[f"{a}.in_proj_z.weight"] = _linear(gen, vd, h, 0.8)
        w[f"{a}.in_proj_b.weight"] = _linear(gen, spec.linear_num_value_heads, h)
        w[f"{a}.in_proj_a.weight"] = _linear(gen, spec.linear_num_value_heads, h)
        w[f"{a}.conv1d.weight"] = 0.5 * torch.randn(2 * kd + vd, 1, spec.linear_conv_kernel_dim, generator=gen)
        w[f"{a}.dt_bias"] = torch.rand(spec.linear_num_value_heads, generator=gen) * 2.0 - 1.0
        w[f"{a}.A_log"] = torch.log(1.0 + 7.0 * torch.rand(spec.linear_num_value_heads, generator=gen))
        w[f"{a}.norm.weight"] = 1.0 + 0.1 * torch.randn(spec.linear_value_head_dim, generator=gen)
        w[f"{a}.out_proj.weight"] = _linear(gen, h, vd, 1.2)
    else:
        d = spec.head_dim
        a = f"{prefix}.self_attn"
        # q_proj carries the query and its output gate (attn_output_gate): 2 x heads x head_dim.
        w[f"{a}.q_proj.weight"] = _linear(gen, 2 * spec.num_attention_heads * d, h, 1.0)
        w[f"{a}.k_proj.weight"] = _linear(gen, spec.num_key_value_heads * d, h, 0.5)
        w[f"{a}.v_proj.weight"] = _linear(gen, spec.num_key_value_heads * d, h, 2.0)
        w[f"{a}.o_proj.weight"] = _linear(gen, h, spec.num_attention_heads * d, 1.2)
        w[f"{a}.q_norm.weight"] = 0.1 * torch.randn(d, generator=gen)
        w[f"{a}.k_norm.weight"] = 0.1 * torch.randn(d, generator=gen)
    m = f"{prefix}.mlp"
    w[f"{m}.gate_proj.weight"] = _linear(gen, spec.intermediate_size, h, 1.0)
    w[f"{m}.up_proj.weight"] = _linear(gen, spec.intermediate_size, h, 1.0)
    w[f"{m}.down_proj.weight"] = _linear(gen, h, spec.intermediate_size, 1.0)
    return w


def float_weights(spec: TinyHybridSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """The model's float32 master weights under checkpoint names, reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(int(seed))
    h = spec.hidden_size
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(spec.vocab_size, h, generator=gen)}
    for i, kind in enumerate(spec.layer_types()):
        w.update(_layer_weights(spec, gen, f"model.layers.{i}", kind))
    w["model.norm.weight"] = 0.1 * torch.randn(h, generator=gen)
    # A head with a wide logit spread, so that the next-token distributions are peaked and a
    # log-probability comparison has something to disagree about.
    w["lm_head.weight"] = _linear(gen, spec.vocab_size, h, 4.0)
    # MTP head: fc over [embedding ; hidden], one full-attention decoder layer, final norm.
    w["mtp.fc.weight"] = _linear(gen, h, 2 * h)
    w["mtp.pre_fc_norm_embedding.weight"] = 0.1 * torch.randn(h, generator=gen)
    w["mtp.pre_fc_norm_hidden.weight"] = 0.1 * torch.randn(h, generator=gen)
    for j in range(spec.mtp_num_hidden_layers):
        w.update(_layer_weights(spec, gen, f"mtp.layers.{j}", "full_attention"))
    w["mtp.norm.weight"] = 0.1 * torch.randn(h, generator=gen)
    return w


def quantized_modules(weights: dict[str, torch.Tensor]) -> dict[str, str]:
    """{checkpoint module name: 'fp8' | 'nvfp4'} for every 2-D weight the plan quantizes."""
    out = {}
    for key, t in weights.items():
        if key.endswith(".weight") and t.dim() == 2:
            module = key[: -len(".weight")]
            region = region_of(module)
            if region is not None:
                out[module] = region
    return out
