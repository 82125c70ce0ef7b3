"""The FP8 family's members, as data (read by kernels/formats.py): e4m3 codes one per byte, times
a float32 scale per tensor or per output channel (the members differ only in that scale)."""
from __future__ import annotations

from ...weight_format import WeightFormat

FP8_TENSOR = WeightFormat(
    key="fp8_tensor", family="fp8", route_prefix="qpn8", algos=("FP8",),
    roles=("codes", "scale"), code_dtype="float8_e4m3fn", codes_per_byte=1,
    group_size=None, output_scale="tensor", title="FP8 per tensor", decoder="DecFP8")
# Not declared by any ModelOpt algo QPN serves (ModelOpt's per-channel FP8 is per-token dynamic in
# its activations); compressed-tensors declares it with weights strategy "channel".
FP8_CHANNEL = WeightFormat(
    key="fp8_channel", family="fp8", route_prefix="qpn8", algos=(),
    roles=("codes", "scale"), code_dtype="float8_e4m3fn", codes_per_byte=1,
    group_size=None, output_scale="channel", title="FP8 per channel", decoder="DecFP8")

MEMBERS = (FP8_TENSOR, FP8_CHANNEL)
RANK = 1
