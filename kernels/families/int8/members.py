"""The INT8 W8A16 family's members, as data (read by kernels/formats.py): unsigned 8-bit codes one
per byte, one float16 scale per group of 32, 64 or 128 inputs or per output channel, and
(asymmetric member) a uint8 zero point per group; the symmetric member's zero point is the
constant 128 (GPTQ's uint8b128, compressed-tensors' signed 8-bit codes stored as q + 128).

GPTQ / GPTQModel and compressed-tensors pack-quantized checkpoints with num_bits 8: the group size
is the checkpoint's choice per weight (group_sizes), per channel included (their group_size -1,
strategy "channel"). No ModelOpt algo declares them. Dense layers only: no grouped MoE kernels.

Per channel is not a member of its own: it is a source with ONE scale (and zero point) column, and
its packed weight holds one group record per row whose span is the padded K rounded up to a power
of two (layout.record_span). Why, from the kernels: both atoms find a k-block's record as
``kb >> group_shift`` (kernels/csrc/qpn_kernels.cu, Frag16INT8Form.record_step) with a group
shift that ops.kernel_member derives from the packed weight's group size, which must be a
power-of-two number of lane runs; a span of at least the padded K maps every k-block to record 0.
So a per-channel weight runs the grouped members' own kernels, decoders and routes unchanged,
loads one record per lane per k-block as the grouped ones do, and the sm_80+ fold kernels apply
its scale once per split-K segment. An output-scale member (the scale in the FP32 epilogue, as
FP8 per channel) would need a decoder without records for the symmetric case and still records
for the asymmetric one's zero points, so two more decoders and kernel sets for no gain in what
is computed.

Served: the one QPN linear method reads GPTQ 8-bit and compressed-tensors pack-quantized num_bits 8
checkpoints through this family's loader schema (loader.py) and the integer conventions' entries
(fork_patches/quant/conventions.py), on the routes qpn8i*.
"""
from __future__ import annotations

from ...weight_format import WeightFormat

GROUP_SIZES = (32, 64, 128)  # each a multiple of both atoms' per-lane input run (32 / 16)
# What GPTQ and compressed-tensors write for one scale per output channel (group_size -1): a
# source with one scale column; codec.quantize takes it as its group size.
CHANNEL = -1

# Route prefix qpn8i ("8-bit integer"): route names are taken apart at their first "_"
# (routes.parse_route) and a name belongs to a prefix only as prefix + "_" (formats.format_for_route),
# so qpn8i_mt2 never reads as FP8's qpn8 and qpn8_mt2 never as this family's.
INT8 = WeightFormat(
    key="int8", family="int8", route_prefix="qpn8i", algos=(),
    roles=("codes", "group_scales", "zero_points"), code_dtype="uint8", codes_per_byte=1,
    group_size=128, output_scale="none", title="INT8 W8A16", group_sizes=GROUP_SIZES,
    scale_dtype="float16", kernel_atoms=("m8n8k4", "m16n8k16"), moe_atoms=(),
    decoder="DecINT8", code_type="int", channel_groups=True)
INT8_SYM = WeightFormat(
    key="int8_sym", family="int8", route_prefix="qpn8i", algos=(),
    roles=("codes", "group_scales"), code_dtype="uint8", codes_per_byte=1,
    group_size=128, output_scale="none", title="INT8 W8A16 symmetric", group_sizes=GROUP_SIZES,
    scale_dtype="float16", kernel_atoms=("m8n8k4", "m16n8k16"), moe_atoms=(),
    kernel_tag="sym", decoder="DecINT8Sym", code_type="int", channel_groups=True)

MEMBERS = (INT8, INT8_SYM)
RANK = 3

# The safetensors dtypes a checkpoint stores each role in (the conventions' header checks before
# boot; the loader registers and checks the loaded tensors by the same table).
STORED_DTYPES = {"codes": ("I32",), "zero_points": ("I32",), "g_idx": ("I32",), "shape": ("I64",),
                 "group_scales": ("F16", "BF16", "F32")}
