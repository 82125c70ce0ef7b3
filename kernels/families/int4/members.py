"""The INT4 W4A16 family's members, as data (read by kernels/formats.py): unsigned 4-bit codes two
per byte, one float16 scale per group of 32, 64 or 128 inputs, and (asymmetric member) a uint4 zero
point per group; the symmetric member's zero point is the constant 8.

AutoAWQ, GPTQ and compressed-tensors pack-quantized checkpoints: the group size is the
checkpoint's choice per weight (group_sizes); group_size is the common default. No ModelOpt algo
declares them (the checkpoint conventions map their configs onto the keys). Dense layers only: no
grouped MoE kernels (an INT4 checkpoint's routed experts stay with the engine's own method).
"""
from __future__ import annotations

from ...weight_format import WeightFormat

GROUP_SIZES = (32, 64, 128)  # each a multiple of both atoms' per-lane input run (32 / 16)

INT4 = WeightFormat(
    key="int4", family="int4", route_prefix="qpn4", algos=(),
    roles=("codes", "group_scales", "zero_points"), code_dtype="uint8", codes_per_byte=2,
    group_size=128, output_scale="none", title="INT4 W4A16", group_sizes=GROUP_SIZES,
    scale_dtype="float16", kernel_atoms=("m8n8k4", "m16n8k16"), moe_atoms=(), decoder="DecINT4", code_type="int")
INT4_SYM = WeightFormat(
    key="int4_sym", family="int4", route_prefix="qpn4", algos=(),
    roles=("codes", "group_scales"), code_dtype="uint8", codes_per_byte=2,
    group_size=128, output_scale="none", title="INT4 W4A16 symmetric", group_sizes=GROUP_SIZES,
    scale_dtype="float16", kernel_atoms=("m8n8k4", "m16n8k16"), moe_atoms=(), kernel_tag="sym",
    decoder="DecINT4Sym", code_type="int")

MEMBERS = (INT4, INT4_SYM)
RANK = 2

# The safetensors dtypes a checkpoint stores each role in (the conventions' header checks before
# boot; the loader registers and checks the loaded tensors by the same table).
STORED_DTYPES = {"codes": ("I32",), "zero_points": ("I32",), "g_idx": ("I32",), "shape": ("I64",),
                 "group_scales": ("F16", "BF16", "F32")}
