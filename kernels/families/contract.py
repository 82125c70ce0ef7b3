"""What a weight family provides: the one contract everything outside kernels/families/ relies on.

A family is a folder kernels/families/<family>/ with

* ``members.py`` (no torch): its ``WeightFormat`` members as module-level names, ``MEMBERS`` (the
  first is the family's representative) and ``RANK`` (where the family stands in lists);
* ``numerics.py``: ``NUMERICS``, a class implementing ``FamilyNumerics`` below, constructed with
  one member (``NUMERICS(fmt)``); its other modules (codec, layout, reference, checkpoint
  unpackers) are the family's own business.

A weight's *source* is the tuple of its checkpoint tensors in the member's ``roles`` order (the
canonical source: what a checkpoint convention hands the family). A *packed* weight is the
family's ``packed_type``, a dataclass deriving from prepack.PackedLayout: ``n``, ``k``, ``atom``,
its tensors as fields, and ``fmt`` (the family's name) or ``format_key`` (the member's key).

The registry (kernels/families/__init__.py) hands out ``numerics(fmt)``; that object is the only
way code outside the family decodes, packs, proves or computes a weight of the family.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..weight_format import WeightFormat


@runtime_checkable
class FamilyNumerics(Protocol):
    fmt: WeightFormat          # the member this instance serves
    packed_type: type          # the family's packed-weight class

    # ---- the canonical source (every value exact: these are the references kernels meet)
    def decode_f64(self, *source) -> torch.Tensor:
        """float64 [N, K], exact."""

    def decode_f32(self, *source) -> torch.Tensor:
        """float32 [N, K] as the kernels' operands see it before their own rounding."""

    def quantize(self, w: torch.Tensor) -> tuple:
        """float [N, K] -> a source of this member (the tools' rounding rules)."""

    # ---- packed layout: only addresses move, and the inverse is proven before a source is freed
    def prepack(self, *source, atom: str = "m8n8k4", rows_per_chunk: int | None = None):
        """source -> packed_type, on the source's device."""

    def unprepack(self, packed) -> tuple:
        """packed -> the source, byte-identical."""

    def verify_roundtrip(self, packed, *source, rows_per_chunk: int | None = None) -> None:
        """Raise prepack.PrepackMismatch naming the first differing byte unless unprepack(packed)
        equals ``source``, every scale and output scale included."""

    # ---- CPU reference, reading the packed buffers the kernels read
    def reference_linear(self, x: torch.Tensor, packed, bias=None) -> torch.Tensor:
        """x [M, K] -> fp16 [M, N] with the kernels' semantics (float32 sums)."""

    def reference_linear_f64(self, x: torch.Tensor, packed, bias=None) -> torch.Tensor:
        """x [M, K] -> float64 [M, N], exact (not rounded)."""

    def decode_packed(self, packed) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 [N, K] before the output scale, float32 [N] output scale per row)."""

    # ---- what a kernel launch reads
    def packed_tensors(self, packed) -> tuple:
        """(codes, group scales or records or None, output scale) a kernel reads."""

    def packed_from_tensors(self, codes, scales, chscale, n: int, k: int, atom: str):
        """The packed weight around kernel tensors (the inverse of packed_tensors)."""

    # ---- vLLM's stacked expert tensors [E, ...] (kernels/moe.py)
    def expert_source(self, e: int, weight, weight_scale, extra=None) -> tuple:
        """The source of expert ``e``."""

    def moe_gate_up_sources(self, wg, wu, w13_scale, w13_extra, inter: int) -> tuple[tuple, tuple]:
        """(gate source, up source) stacks from vLLM's fused w13 tensors."""

    def moe_down_source(self, w2, w2_scale, w2_extra=None) -> tuple:
        """The down projection's source stack."""


# What a family's numerics class must define: the contract's methods, and its packed type.
REQUIRED = tuple(name for name, v in vars(FamilyNumerics).items()
                 if not name.startswith("_") and callable(v)) + ("packed_type",)


def missing(cls: type) -> list[str]:
    """The members of the contract ``cls`` lacks (the registry refuses such a class by name)."""
    return [name for name in REQUIRED if not hasattr(cls, name)]
