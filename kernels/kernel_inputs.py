"""What a dense QPN kernel launch reads, shared by the SM70 path (ops) and the sm_80+ launch
planning (sm80_plan): the packed weight as one ``WeightOperands`` record, the format member whose
kernels serve it, the activations, bias and result scale as the kernels take them, and the block
every dense kernel runs in.

A packed weight reaches the kernels as one ``WeightOperands`` record: built once per call by
``operands(packed)``, handed whole to every launcher, and spread into the custom op's arguments
(torch.library ops take tensors and scalars, not records) in its field order.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import families, formats
from .atoms import geometry
from .prepack import PackedLayout

# Threads per block of every dense kernel (QPN_THREADS, QPN80_THREADS in csrc/).
THREADS = 256
WARPS = THREADS // 32


class WeightOperands(NamedTuple):
    """A packed weight as the kernels and the reference read it. Its fields, in this order, are
    the custom op's weight arguments (``qpn::linear``)."""
    codes: torch.Tensor              # uint8, fragment order
    scales: Optional[torch.Tensor]   # NVFP4 e4m3 group scales / INT4 group records (fragment order); None for FP8
    chscale: torch.Tensor            # scale of the result: NVFP4 global [1]; FP8 [1] or [N]; INT4 [1] = 1
    n: int
    k: int
    fmt: str                         # the kernel family (formats.KERNEL_FAMILIES key)
    atom: str

    # padded sizes, as every packed weight answers them (a NamedTuple cannot subclass PackedLayout)
    n_pad = PackedLayout.n_pad
    k_pad = PackedLayout.k_pad

    @property
    def format(self) -> formats.WeightFormat:
        """The kernel family's description (``formats.KERNEL_FAMILIES``)."""
        return formats.KERNEL_FAMILIES[self.fmt]

    def packed(self):
        """The packed weight (PackedNVFP4, PackedFP8, ...) these operands came from (what the
        reference reads)."""
        return families.numerics(self.format).packed_from_tensors(self.codes, self.scales, self.chscale,
                                                                self.n, self.k, self.atom)


# The packed dense weight class of each format family with its numerics, resolved once
# (operands() runs under torch.compile).
_DENSE_PACKED = tuple((families.numerics(f).packed_type, f, families.numerics(f))
                      for f in formats.KERNEL_FAMILIES.values())


def operands(packed) -> WeightOperands:
    """The WeightOperands of a packed dense weight, from its format's ``packed_tensors`` (the
    inverse of WeightOperands.packed)."""
    for packed_type, f, num in _DENSE_PACKED:
        if isinstance(packed, packed_type):
            return WeightOperands(*num.packed_tensors(packed), packed.n, packed.k, f.family, packed.atom)
    kinds = " or ".join(t.__name__ for t, _, _ in _DENSE_PACKED)
    raise TypeError(f"expected a packed dense weight ({kinds}), got {type(packed).__name__}")


def kernel_member(w: WeightOperands) -> tuple[formats.WeightFormat, int]:
    """(the format member whose kernels serve ``w``, log2 of a lane's input runs per group record:
    m8n8k4 k-blocks of 32, m16n8k16 runs of 16, AtomGeometry.lane_run). Only a family whose weights
    choose their group size (``group_sizes``: INT4) has either to read off the tensors (the packed
    weight names its member and group size); the others run the family's kernels, whose group is
    fixed."""
    f = w.format
    if w.atom not in f.kernel_atoms:
        raise ValueError(f"{f.title} has no {w.atom} kernels (they exist for {', '.join(f.kernel_atoms)}); "
                         f"prepack it with atom={f.kernel_atoms[-1]!r}, or run it on the CPU reference")
    if not f.group_sizes:
        return f, 0
    p = w.packed()
    run = geometry(w.atom).lane_run
    kpg = p.group_size // run
    if kpg < 1 or kpg & (kpg - 1) or p.group_size % run:
        raise ValueError(f"{f.title}: group size {p.group_size} is not a power-of-two number of "
                         f"{w.atom} lane runs ({run} inputs)")
    return formats.format_of(p), kpg.bit_length() - 1


def fp16_activations(x2: torch.Tensor, k: int, k_pad: int) -> torch.Tensor:
    """x [M, K] as the kernels read it (dense and MoE alike): FP16, K zero-padded to ``k_pad``,
    contiguous and 16-byte aligned."""
    xh = x2.to(torch.float16)
    if k_pad != k:
        xh = torch.nn.functional.pad(xh, (0, k_pad - k))
    if not xh.is_contiguous() or xh.data_ptr() % 16:
        xh = xh.contiguous().clone()
    return xh


def bias16(bias: Optional[torch.Tensor], n: int, device) -> Optional[torch.Tensor]:
    if bias is None:
        return None
    if bias.numel() != n:
        raise ValueError(f"bias has {bias.numel()} elements, the layer has N={n} outputs")
    return bias.reshape(n).to(device=device, dtype=torch.float16).contiguous()


def fp32_scale(w: WeightOperands) -> WeightOperands:
    """The operands with the result scale as the flat FP32 tensor the kernels read."""
    return w._replace(chscale=w.chscale.to(torch.float32).reshape(-1))
