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

A family that checkpoints store has a ``loader.py`` too: ``LOADER``, implementing ``FamilyLoader``
below, the loader schema the one QPN linear method (fork_patches/quant/linear_method.py) registers
and checks a module's tensors by, and through which it turns them into sources (shard fusion
included). ``loader(fmt)`` of the registry hands it out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from ..weight_format import FormatError, WeightFormat, symbol_shape


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


# ============================================================================ the loader schema
class LoadError(FormatError):
    """A checkpoint module's tensors that are not what its convention and scheme declare; the
    message names the problem (the linear method prefixes the module)."""


@dataclass(frozen=True)
class StoredTensor:
    """One tensor a checkpoint module stores, as the loader registers it.

    ``symbols``: the stored shape in symbols of the module's N outputs, K inputs, group size g and
    P fused output shards: "N", "K", "K/2" (two values per element), "K/g" (one per group), "N/8"
    (eight values per int32 word, rounded up), "P" (one per shard), or a number. The linear method
    derives vLLM's parameter class from them (which axis is the input, the output, the packed one),
    so the engine's fused and tensor-parallel loaders narrow each tensor as they do their own."""

    role: str                          # the family's role (the source's, or a stored extra)
    name: str                          # the checkpoint tensor name = the parameter name
    symbols: tuple[str, ...]
    dtype: torch.dtype                 # the dtype the parameter is registered in
    accepted: tuple[torch.dtype, ...]  # the dtypes a checkpoint may store it in
    required: bool = True              # False: read when the checkpoint has it
    scale: bool = False                # checked finite and >= 0 as it is loaded
    packed_factor: int = 0             # values per int32 word along the axis written "/<factor>"

    def shape(self, n: int, k: int, g: int = 0, parts: int = 1) -> tuple[int, ...]:
        """The shape the symbols give for N = ``n``, K = ``k``, group ``g`` and ``parts`` shards."""
        return symbol_shape(self.symbols, n, k, g, parts=parts)


@runtime_checkable
class FamilyLoader(Protocol):
    """How a family's checkpoint modules load. ``names`` is the convention's RoleNames for the
    family, ``convention`` the convention object, ``scheme`` what the config declares for the
    module (``scheme.format`` is the member)."""

    def stored(self, names, convention, scheme) -> tuple[StoredTensor, ...]:
        """Every tensor a module may store, in registration order."""

    def geometry_problem(self, parts: list[int], k: int, k_full: int, convention, scheme) -> str | None:
        """Why a module of these output partitions (this rank's rows per fused shard) and K inputs
        (``k`` on this rank, ``k_full`` in the checkpoint) cannot be served; None if it can."""

    def value_problem(self, spec: StoredTensor, t: torch.Tensor, rows: int, k_full: int, convention,
                      scheme, module: str) -> str | None:
        """What is wrong with the values of a loaded tensor beyond dtype and shape (a scale float16
        cannot hold, a stored shape that disagrees, an act-ordered map); None if nothing."""

    def sources(self, tensors: dict[str, torch.Tensor], parts: list[int], names, convention, scheme,
                module: str, extra: dict[str, Any]) -> list[tuple[int, int, tuple]]:
        """(row0, row1, source) pieces covering the module's rows, from its loaded tensors by role;
        ``extra`` carries what the loader kept per shard (``g_idx``: {part: map}, ``first_group``:
        this rank's first group). Raises LoadError naming the problem."""


LOADER_REQUIRED = tuple(name for name, v in vars(FamilyLoader).items()
                        if not name.startswith("_") and callable(v))
