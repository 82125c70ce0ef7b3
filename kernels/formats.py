"""The numeric weight formats QPN serves, gathered from the families: every format is a member of
one family (kernels/families/<family>/members.py, one ``WeightFormat`` each) and everything that
depends on a weight's format asks its ``WeightFormat`` instead of comparing format strings.

A description (``WeightFormat``, kernels/weight_format.py) says what a checkpoint stores (code and
scale dtypes, codes per byte, group size, how the output scale applies) and which route family,
kernel entry points and CUDA decoders serve it: the m8n8k4 entry lines of csrc/qpn_kernels.cu are
written from it (jit.sm70_entry_lines). How a tensor of the format is decoded, encoded, prepacked,
proven and computed on the CPU is its family's package (kernels/families/<family>/, behind the
contract of kernels/families/contract.py), which ``families.numerics(fmt)`` hands out.

This module imports no torch (the launcher's gates and the convention readers use it on configs
alone) and no other kernels module but weight_format and the families' ``members`` modules, which
it finds by folder: a family is a folder of kernels/families/ with a members.py, and adding one
edits nothing here. Each member's module-level name (``NVFP4``, ``FP8_TENSOR``, ...) is also an
attribute of this module, so callers outside the families can name a member as ``formats.<NAME>``.

A weight's *source* is the tuple of checkpoint tensors in the format's ``roles`` order (each
family's package documents its roles' dtypes and shapes). Checkpoint conventions
(fork_patches/quant/conventions.py) map their tensor names onto these roles.

Lookup: ``weight_format(x)`` takes a format key, a kernel family name (the family's first member),
a ModelOpt ``quant_algo``, or a WeightFormat; ``format_of(packed)`` answers for a packed weight;
``format_for_route(route)`` for a QPN route name. These look up SERVED formats only unless asked
with ``served_only=False`` (families.numerics does: the numerics of every format exist).

Staging: a format can be registered before a loader serves it (``served=False``): its numerics,
and its kernels where it lists ``kernel_atoms``, are built and tested, but the served lists (routes'
QPN_ROUTES, jit.ENTRY_POINTS, the census, the boot gates) leave it out; its dense routes and kernels
wait in routes.UNSERVED_ROUTES, jit.UNSERVED_ENTRY_POINTS and sm80_tables.SM80_UNSERVED_ROUTE_KERNELS.
Mixture-of-experts kernels exist for the formats whose ``moe_atoms`` name an atom: only those have
a MoE route.

Group size: ``group_size`` is the format's default; a format whose checkpoints choose the group
size per weight lists the choices in ``group_sizes`` and a packed weight carries its own (the
source implies it: K / group_scales columns).
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from .weight_format import (ATOMS, E2M1_MAX, E4M3_MAX, ActOrderError, FormatError,  # noqa: F401
                            M8N8K4Kernel, MoeShapeError,
                            UnknownFormat, WeightFormat)

FAMILIES_DIR = Path(__file__).resolve().parent / "families"


def _family_member_modules() -> list:
    """The ``members`` module of every family folder, in the families' RANK order."""
    names = sorted(p.parent.name for p in FAMILIES_DIR.glob("*/members.py"))
    mods = [importlib.import_module(f"{__package__}.families.{name}.members") for name in names]
    return sorted(mods, key=lambda m: m.RANK)


_FAMILY_MODULES = _family_member_modules()
# each member by its module-level name (formats.NVFP4, formats.INT4_SYM, ...)
globals().update({name: v for mod in _FAMILY_MODULES for name, v in vars(mod).items()
                  if isinstance(v, WeightFormat)})

# Every format with numerics (families.numerics); one member per kernel family in ALL_FAMILIES
# (the family's first member).
ALL_FORMATS: tuple[WeightFormat, ...] = tuple(m for mod in _FAMILY_MODULES for m in mod.MEMBERS)
ALL_FAMILIES: dict[str, WeightFormat] = {mod.MEMBERS[0].family: mod.MEMBERS[0] for mod in _FAMILY_MODULES}
# What the kernels serve: the routes, kernel builds and checkpoint gates read only these.
WEIGHT_FORMATS: tuple[WeightFormat, ...] = tuple(f for f in ALL_FORMATS if f.served)
# One member per kernel family: the formats that differ only in how the output scale is stored
# share the family's packed layout, routes and kernels.
FAMILIES: dict[str, WeightFormat] = {k: f for k, f in ALL_FAMILIES.items() if f.served}
# The served families with grouped MoE kernels (kernels/moe.py; their MoE routes, routes.QPN_MOE_ROUTES).
MOE_FAMILIES: dict[str, WeightFormat] = {k: f for k, f in FAMILIES.items() if f.moe_atoms}
MODELOPT_ALGOS: dict[str, WeightFormat] = {a: f for f in WEIGHT_FORMATS for a in f.algos}
# What ops can run through kernels: every format with dense kernels on some atom, served or not
# (routes.route_for(..., served_only=False), jit.UNSERVED_ENTRY_POINTS); one member per family.
KERNEL_FORMATS: tuple[WeightFormat, ...] = tuple(f for f in ALL_FORMATS if f.kernel_atoms)
KERNEL_FAMILIES: dict[str, WeightFormat] = {k: f for k, f in ALL_FAMILIES.items() if f.kernel_atoms}


def _names() -> str:
    return ", ".join([f.key for f in WEIGHT_FORMATS] + sorted(FAMILIES) + sorted(MODELOPT_ALGOS))


def find_format(name_or_algo: Any, served_only: bool = True) -> WeightFormat | None:
    """The WeightFormat a key, family name or ModelOpt algo (any case) names; None if none (or,
    with ``served_only``, if the format it names is not served yet)."""
    if isinstance(name_or_algo, WeightFormat):
        return name_or_algo
    s = str(name_or_algo)
    for f in ALL_FORMATS:
        if s.lower() == f.key:
            return f if f.served or not served_only else None
    f = ALL_FAMILIES.get(s.lower()) or MODELOPT_ALGOS.get(s.upper())
    return None if f is None or (served_only and not f.served) else f


def weight_format(name_or_algo: Any, output_scale: str | None = None, served_only: bool = True) -> WeightFormat:
    """The WeightFormat named; ``output_scale`` picks the member of a family whose members differ
    only in how the output scale is stored (FP8: "tensor" | "channel")."""
    f = find_format(name_or_algo, served_only)
    if f is None:
        pending = find_format(name_or_algo, served_only=False)
        why = ""
        if pending:
            why = (f" ({pending.title} has QPN kernels but no served route yet)" if pending.kernel_atoms
                   else f" ({pending.title} has CPU numerics but no QPN kernels yet)")
        raise UnknownFormat(f"unknown weight format or quant algo {name_or_algo!r}{why}; QPN serves {_names()}")
    # a family whose members differ only in how the output scale is stored: pick the member
    members = {m.output_scale: m for m in ALL_FORMATS if m.family == f.family}
    if output_scale is not None and len(members) > 1:
        f = members.get(output_scale)
        if f is None:
            raise UnknownFormat(f"unknown {name_or_algo!s} scale layout {output_scale!r}; expected "
                                + " or ".join(repr(k) for k in members))
    return f


def members_of(family: str) -> tuple[WeightFormat, ...]:
    """Every member of a family (served or not), in its package's order."""
    return tuple(m for m in ALL_FORMATS if m.family == family)


def integer_family(bits: int) -> str | None:
    """The family of unsigned ``bits``-bit integer codes (``code_type`` "int"), served or not; None
    if no family has such codes."""
    return next((m.family for m in ALL_FORMATS if m.code_type == "int" and m.code_bits == bits), None)


def format_of(packed) -> WeightFormat:
    """The WeightFormat of a packed weight or expert stack (by its ``format_key`` where it names
    its member itself, else by its ``fmt`` and scale layout)."""
    key = getattr(packed, "format_key", None)
    if key is not None:
        return weight_format(key, served_only=False)
    f = weight_format(packed.fmt)
    if getattr(packed, "per_channel", False):   # the family's per-channel member, where it has one
        return next((m for m in ALL_FORMATS if m.family == f.family and m.output_scale == "channel"), f)
    return f


def format_for_route(route: str, served_only: bool = True) -> WeightFormat:
    """The family member (``FAMILIES``; with ``served_only`` False, ``KERNEL_FAMILIES``) whose
    routes or kernels include ``route`` (by its prefix)."""
    for f in (FAMILIES if served_only else KERNEL_FAMILIES).values():
        if route == f.route_prefix or route.startswith(f.route_prefix + "_"):
            return f
    raise UnknownFormat(f"route {route!r} belongs to no QPN format (route prefixes: "
                        f"{', '.join(f.route_prefix for f in FAMILIES.values())})")

