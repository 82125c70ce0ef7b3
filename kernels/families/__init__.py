"""The weight families: one package per family (kernels/families/<family>/), each behind the one
contract of contract.py, and the registry through which everything outside the families reaches
them.

A family package holds everything that differs between families: its members as data
(members.py, gathered by kernels/formats.py), its codec, packed layout with the proven inverse and
fragment maps per atom, and its CPU reference (each package's own modules say which). Its
``numerics`` module names the class that implements the contract (``NUMERICS``); ``numerics(fmt)``
below hands out an instance per member. Adding a family is adding a folder: the registry finds it
by the family names formats.py gathered, and no list here is extended.

Importing this package imports no torch: formats.py (torch-free) loads the members modules of the
packages, which imports this file first. The numerics are imported on first use.
"""
from __future__ import annotations

import importlib
from functools import lru_cache
from typing import Any

from .. import formats


class ContractError(TypeError):
    """A family package whose numerics class does not implement kernels/families/contract.py."""


# an integer family's g_idx that reorders inputs within groups (kernels/weight_format.py)
ActOrder = formats.ActOrderError


def members_module(family: str):
    """kernels/families/<family>/members.py (torch-free data: the members and what the family's
    checkpoints store, STORED_DTYPES where it has integer conventions)."""
    return importlib.import_module(f"{__name__}.{family}.members")


@lru_cache(maxsize=None)
def numerics_class(family: str) -> type:
    """The class implementing the contract for ``family``: ``NUMERICS`` of its numerics module,
    refused by name when it lacks a member of the contract."""
    from . import contract

    cls = getattr(importlib.import_module(f"{__name__}.{family}.numerics"), "NUMERICS", None)
    lacks = ["NUMERICS"] if cls is None else contract.missing(cls)
    if lacks:
        raise ContractError(f"kernels/families/{family}/numerics.py does not implement the family contract "
                            f"(kernels/families/contract.py): it lacks {', '.join(lacks)}")
    return cls


@lru_cache(maxsize=None)
def _numerics_of(key: str):
    fmt = formats.weight_format(key, served_only=False)
    return numerics_class(fmt.family)(fmt)


def numerics(fmt: Any):
    """The numerics (contract.FamilyNumerics) of a WeightFormat, a format key, family name or
    ModelOpt algo, or of the format of a packed weight (anything with a ``format`` or ``fmt``)."""
    if hasattr(fmt, "n") and hasattr(fmt, "atom"):  # a packed weight or expert stack
        fmt = formats.format_of(fmt)
    return _numerics_of(formats.weight_format(fmt, served_only=False).key)


@lru_cache(maxsize=None)
def loader_of(family: str):
    """``LOADER`` of kernels/families/<family>/loader.py, refused by name when it lacks a member of
    contract.FamilyLoader."""
    from . import contract

    obj = getattr(importlib.import_module(f"{__name__}.{family}.loader"), "LOADER", None)
    lacks = ["LOADER"] if obj is None else [n for n in contract.LOADER_REQUIRED if not hasattr(obj, n)]
    if lacks:
        raise ContractError(f"kernels/families/{family}/loader.py does not implement the loader schema "
                            f"(kernels/families/contract.py FamilyLoader): it lacks {', '.join(lacks)}")
    return obj


def loader(fmt: Any):
    """The loader schema (contract.FamilyLoader) of a WeightFormat, key or family name."""
    return loader_of(formats.weight_format(fmt, served_only=False).family)


def family_modules(module: str) -> list:
    """kernels/families/<family>/<module>.py of every family that has one, in the families' order
    (sm80_tables gathers the ``kernels_sm80`` tables this way)."""
    out = []
    for family in formats.ALL_FAMILIES:
        name = f"{__name__}.{family}.{module}"
        try:
            out.append(importlib.import_module(name))
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
    return out


def packed_types() -> tuple[type, ...]:
    """The packed-weight class of every family."""
    return tuple(numerics_class(family).packed_type for family in formats.ALL_FAMILIES)


def kernel_tensors(packed):
    """(codes, group scales or None, float32 output scale [1] or [N]) a kernel reads."""
    codes, scales, out_scale = numerics(packed).packed_tensors(packed)
    return codes, scales, out_scale.float().reshape(-1)


def reference_linear(x, packed, bias=None):
    """The float32 CPU reference (the kernels' semantics, FP16 output) of a packed dense weight of
    any family."""
    return numerics(packed).reference_linear(x, packed, bias)


def reference_linear_f64(x, packed, bias=None):
    """The exact float64 CPU reference (not rounded) of a packed dense weight of any family."""
    return numerics(packed).reference_linear_f64(x, packed, bias)
