"""Which numerics serve which weight format: the one place a format's data (formats.py) meets
its family's implementation (kernels/family_<family>.py: family_nvfp4.py, family_fp8.py,
family_int4.py). Callers that handle tensors ask ``numerics(fmt)``; callers that only read
configs stay on formats.py, which imports no torch.
"""
from __future__ import annotations

import importlib
from typing import Any

import torch

from . import formats


def _family_numerics(family: str) -> type:
    """The numerics class of a kernel family: ``NUMERICS`` of its module, kernels/family_<family>.py.
    Found by the family's registered name, so that a new family is its WeightFormat and its module,
    with no list here to extend."""
    return importlib.import_module(f"{__package__}.family_{family}").NUMERICS


# kernel family -> its numerics class (one per family module)
# (every format with numerics, served or not: formats.ALL_FORMATS)
NUMERICS = {family: _family_numerics(family) for family in formats.ALL_FAMILIES}
_BY_KEY = {f.key: NUMERICS[f.family](f) for f in formats.ALL_FORMATS}


def numerics(fmt: Any):
    """The numerics of a WeightFormat, a format key, family name or ModelOpt algo, or of the
    format of a packed weight (anything with a ``format`` or ``fmt``)."""
    if hasattr(fmt, "n") and hasattr(fmt, "atom"):  # a packed weight or expert stack
        fmt = formats.format_of(fmt)
    return _BY_KEY[formats.weight_format(fmt, served_only=False).key]


def packed_types() -> tuple[type, ...]:
    return tuple(cls.packed_type for cls in NUMERICS.values())


def kernel_tensors(packed):
    """(codes, group scales or None, float32 output scale [1] or [N]) a kernel reads."""
    codes, scales, out_scale = numerics(packed).packed_tensors(packed)
    return codes, scales, out_scale.to(torch.float32).reshape(-1)
