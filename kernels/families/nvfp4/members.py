"""The NVFP4 family's members, as data (read by kernels/formats.py): e2m1 codes two per byte, one
e4m3 scale per 16 inputs, one float32 global multiplier."""
from __future__ import annotations

from ...weight_format import WeightFormat

GROUP_SIZE = 16   # inputs per e4m3 group scale

NVFP4 = WeightFormat(
    key="nvfp4", family="nvfp4", route_prefix="qpn2", algos=("NVFP4", "W4A16_NVFP4"),
    roles=("codes", "group_scales", "global_scale"), code_dtype="uint8", codes_per_byte=2,
    group_size=GROUP_SIZE, output_scale="global", title="NVFP4", decoder="DecNVFP4", s7_decoder="DecNVFP4S7")

# The family's members, its first the family's representative; RANK: where the family stands in
# every list of families (routes, census, docs), the order in which families were added.
MEMBERS = (NVFP4,)
RANK = 0
