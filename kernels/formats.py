"""The numeric weight formats QPN serves, as data: NVFP4, FP8 per tensor, FP8 per output channel,
and INT4 W4A16 (asymmetric, with zero points, and symmetric).
Everything that depends on a weight's format asks its ``WeightFormat`` here instead of comparing
format strings.

A description says what a checkpoint stores (code and scale dtypes, codes per byte, group size,
how the output scale applies) and which route family, kernel entry points and CUDA decoders serve
it: the m8n8k4 entry lines of csrc/qpn_kernels.cu are written from it (jit.sm70_entry_lines). How a
tensor of the format is decoded, encoded, prepacked, proven and computed on the CPU is its
family's module (family_nvfp4.py, family_fp8.py, family_int4.py), which ``families.numerics(fmt)``
hands out.
This module is the bottom layer of kernels/: it imports nothing of the package and no torch (the
launcher's gates and the convention readers use it on configs alone).

A weight's *source* is the tuple of checkpoint tensors in the format's ``roles`` order:
NVFP4 (codes uint8 [N, K/2], group_scales float8_e4m3fn [N, K/16], global_scale float32, the
multiplier); FP8 (codes float8_e4m3fn [N, K], scale float32 [1] per tensor or [N] per channel);
INT4 (codes uint8 [N, K/2], low nibble = even k; group_scales float16 [N, K/g]; zero_points
uint8 [N, K/g] holding 0..15, asymmetric member only; w = (code - zero) * scale, symmetric zero 8).
Checkpoint conventions (fork_patches/quant/conventions.py) map their tensor names onto these roles.

Lookup: ``weight_format(x)`` takes a format key ("nvfp4", "fp8_tensor", "fp8_channel", "int4",
"int4_sym"), a kernel family name ("nvfp4", "fp8", "int4": the family's first member), a ModelOpt
``quant_algo`` ("NVFP4", "W4A16_NVFP4", "FP8"), or a WeightFormat; ``format_of(packed)`` answers
for a packed weight; ``format_for_route(route)`` for a QPN route name. These look up SERVED formats
only unless asked with ``served_only=False`` (families.numerics does: the numerics of every format
exist).

Staging: a format can be registered before a loader serves it (``served=False``): its numerics,
and its kernels where it lists ``kernel_atoms``, are built and tested, but the served lists (routes'
QPN_ROUTES, jit.ENTRY_POINTS, the census, the boot gates) leave it out; its dense routes and kernels
wait in routes.UNSERVED_ROUTES, jit.UNSERVED_ENTRY_POINTS and sm80_tables.SM80_UNSERVED_ROUTE_KERNELS
(INT4 came this way; no registered format is staged today). Mixture-of-experts kernels exist for the
formats whose ``moe_atoms`` name an atom (NVFP4, FP8; not INT4): only those have a MoE route.

Group size: ``group_size`` is the format's default; a format whose checkpoints choose the group
size per weight lists the choices in ``group_sizes`` (INT4: 32, 64, 128) and a packed weight
carries its own (the source implies it: K / group_scales columns).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

GROUP_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
INT4_GROUP_SIZES = (32, 64, 128)  # each a multiple of both atoms' per-lane input run (32 / 16)
ATOMS = ("m8n8k4", "m16n8k16")


class FormatError(ValueError):
    """A tensor does not have the shape or dtype its format requires."""


class UnknownFormat(FormatError):
    """A format name, quant algo or route that names no QPN weight format."""


class MoeShapeError(ValueError):
    """Expert tensors or routing tensors of the wrong shape, dtype or device."""


class M8N8K4Kernel(NamedTuple):
    """One dense m8n8k4 kernel of a format and what instantiates it in csrc/qpn_kernels.cu
    (kernels/jit.py writes its entry line from this before NVRTC compiles the file)."""
    name: str      # the entry point
    decoder: str   # the decoder struct of csrc/qpn_family.cuh it is instantiated with
    tiles: int     # 8-token tiles per weight pass; 0: the workspace reconstruction pass


@dataclass(frozen=True)
class WeightFormat:
    key: str               # unique name of this description
    family: str            # kernel family: packed layout, census region, route family ("nvfp4" | "fp8" | "int4")
    route_prefix: str      # QPN route names of the family start with it ("qpn2" | "qpn8" | "qpn4")
    algos: tuple[str, ...]  # ModelOpt quant_algo values that declare it
    roles: tuple[str, ...]  # the source tensors, in order
    code_dtype: str        # torch dtype name of the checkpoint codes
    codes_per_byte: int    # 2: two e2m1 codes per uint8; 1: one e4m3 byte per code
    group_size: int | None  # inputs per e4m3 group scale (None: no group scales)
    output_scale: str      # how the float32 output scale applies: "global" | "tensor" | "channel" | "none"
    title: str             # for messages: "NVFP4", "FP8 per tensor", ...
    # group sizes a checkpoint may choose per weight (() = group_size only)
    group_sizes: tuple[int, ...] = ()
    scale_dtype: str = "float8_e4m3fn"  # torch dtype name of the group scales
    served: bool = True    # False: staged (see the module): no loader, served route list, census or gate names it
    # atoms whose dense kernels exist for this format (ops runs them, served or not); () = numerics only
    kernel_atoms: tuple[str, ...] = ("m8n8k4", "m16n8k16")
    # atoms whose grouped mixture-of-experts kernels (kernels/moe.py) exist for this format; () = none,
    # so no MoE route (routes.QPN_MOE_ROUTES) and no MoE entry point names it
    moe_atoms: tuple[str, ...] = ("m8n8k4", "m16n8k16")
    # members of one family whose kernels differ (INT4: with / without zero points) tell their kernel
    # names apart by this tag after the route prefix ("qpn4_sym_mt1_m8n8k4"); "" = the family's names
    kernel_tag: str = ""
    # the decoder struct of csrc/qpn_family.cuh the member's m8n8k4 kernels are instantiated with
    # (required with the m8n8k4 atom), and that of the S7 form of its tiled kernels, where its group
    # scale can carry 2^7 ("": no S7 form; ops.nvfp4_form)
    decoder: str = ""
    s7_decoder: str = ""

    def __post_init__(self):
        if "m8n8k4" in self.kernel_atoms and not self.decoder:
            raise ValueError(f"{self.key}: a format with m8n8k4 kernels names its decoder struct (decoder=)")

    # ------------------------------------------------------------------------- shapes
    @property
    def has_group_scales(self) -> bool:
        return self.group_size is not None

    @property
    def has_zero_points(self) -> bool:
        return "zero_points" in self.roles

    @property
    def allowed_group_sizes(self) -> tuple[int, ...]:
        return self.group_sizes or ((self.group_size,) if self.group_size else ())

    @property
    def scale_name(self) -> str:
        """The group scales' type in messages ("e4m3", "float16")."""
        return {"float8_e4m3fn": "e4m3"}.get(self.scale_dtype, self.scale_dtype)

    @property
    def bytes_per_weight(self) -> float:
        """Bytes of checkpoint data per weight element at the default group size: codes plus
        group scales (plus zero points, half a byte each stored as nibbles)."""
        if not self.group_size:
            return 1 / self.codes_per_byte
        scale_bytes = 2 if self.scale_dtype in ("float16", "bfloat16") else 1
        return 1 / self.codes_per_byte + (scale_bytes + 0.5 * self.has_zero_points) / self.group_size

    @property
    def moe_route(self) -> str:
        return self.route_prefix + "_moe"

    @property
    def method_family(self) -> str:
        """The route family's name in messages ("QPN2")."""
        return self.route_prefix.upper()

    def code_cols(self, k: int) -> int:
        """Columns of the checkpoint codes tensor for K inputs."""
        return k // self.codes_per_byte

    def group_scale_cols(self, k: int, group_size: int | None = None) -> int | None:
        g = group_size or self.group_size
        return None if g is None else k // g

    def check_k(self, k: int, group_size: int | None = None) -> None:
        """Raise FormatError unless K inputs can be stored in this format (with ``group_size``,
        one of ``allowed_group_sizes``; default: the format's group size)."""
        g = group_size or self.group_size
        if group_size is not None and group_size not in self.allowed_group_sizes:
            raise FormatError(f"{self.title} has no group size {group_size}; it stores groups of "
                              f"{', '.join(map(str, self.allowed_group_sizes))} inputs")
        if g is not None and k % g:
            raise FormatError(f"{self.title} needs K to be a multiple of {g} (one {self.scale_name} "
                              f"scale per {g} inputs); got K={k}")

    # ----------------------------------------------------------------- kernel entry points
    @property
    def kernel_prefix(self) -> str:
        """The start of this member's kernel names: the route prefix, plus the member's tag."""
        return f"{self.route_prefix}_{self.kernel_tag}" if self.kernel_tag else self.route_prefix

    @property
    def has_s7_form(self) -> bool:
        """Whether the m8n8k4 tiled kernels also come in the S7 form (ops.nvfp4_form), which folds
        2^7 into an e4m3 group scale (DecNVFP4Form): the format names that form's decoder."""
        return bool(self.s7_decoder)

    def m8n8k4_kernels(self) -> tuple[M8N8K4Kernel, ...]:
        """The dense m8n8k4 kernels of the format (one-tile, two-tile, their S7 forms where it has
        them, workspace reconstruction), each with its decoder and token tiles: what
        csrc/qpn_kernels.cu instantiates for it (jit.sm70_entry_lines). None without that atom."""
        if "m8n8k4" not in self.kernel_atoms:
            return ()
        p = self.kernel_prefix
        forms = (("", self.decoder),) + ((("_s7", self.s7_decoder),) if self.has_s7_form else ())
        tiled = tuple(M8N8K4Kernel(f"{p}_mt{mt}{form}_m8n8k4", dec, mt) for form, dec in forms for mt in (1, 2))
        return tiled + (M8N8K4Kernel(f"{p}_reconstruct_ws_m8n8k4", self.decoder, 0),)

    def dense_entry_points(self, atom: str) -> tuple[str, ...]:
        """The dense kernels of the format: on the m8n8k4 atom those of ``m8n8k4_kernels``; on
        m16n8k16 the workspace reconstruction (the configured kernels are listed in
        kernels/sm80_tables.py). None on an atom outside ``kernel_atoms``."""
        if atom not in self.kernel_atoms:
            return ()
        if atom == "m8n8k4":
            return tuple(k.name for k in self.m8n8k4_kernels())
        return (f"{self.kernel_prefix}_reconstruct_ws_{atom}",)

    def moe_entry_points(self, atom: str) -> tuple[str, ...]:
        """The grouped MoE kernels of the format on ``atom`` (gate/up, down); none on an atom outside
        ``moe_atoms``."""
        if atom not in self.moe_atoms:
            return ()
        p = self.route_prefix
        return (f"{p}_moe_gate_up_{atom}", f"{p}_moe_down_{atom}")

    def __str__(self) -> str:
        return self.key


NVFP4 = WeightFormat(
    key="nvfp4", family="nvfp4", route_prefix="qpn2", algos=("NVFP4", "W4A16_NVFP4"),
    roles=("codes", "group_scales", "global_scale"), code_dtype="uint8", codes_per_byte=2,
    group_size=GROUP_SIZE, output_scale="global", title="NVFP4", decoder="DecNVFP4", s7_decoder="DecNVFP4S7")
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

# W4A16 integer weights (AutoAWQ, GPTQ, compressed-tensors pack-quantized): the group size is the
# checkpoint's choice per weight (group_sizes); group_size is the common default. No ModelOpt algo
# declares them (the checkpoint conventions map their configs onto the keys). Dense layers only:
# no grouped MoE kernels (an INT4 checkpoint's routed experts stay with the engine's own method).
INT4 = WeightFormat(
    key="int4", family="int4", route_prefix="qpn4", algos=(),
    roles=("codes", "group_scales", "zero_points"), code_dtype="uint8", codes_per_byte=2,
    group_size=128, output_scale="none", title="INT4 W4A16", group_sizes=INT4_GROUP_SIZES,
    scale_dtype="float16", kernel_atoms=("m8n8k4", "m16n8k16"), moe_atoms=(), decoder="DecINT4")
INT4_SYM = WeightFormat(
    key="int4_sym", family="int4", route_prefix="qpn4", algos=(),
    roles=("codes", "group_scales"), code_dtype="uint8", codes_per_byte=2,
    group_size=128, output_scale="none", title="INT4 W4A16 symmetric", group_sizes=INT4_GROUP_SIZES,
    scale_dtype="float16", kernel_atoms=("m8n8k4", "m16n8k16"), moe_atoms=(), kernel_tag="sym",
    decoder="DecINT4Sym")

# Every format with numerics (families.numerics); one member per kernel family in ALL_FAMILIES.
ALL_FORMATS: tuple[WeightFormat, ...] = (NVFP4, FP8_TENSOR, FP8_CHANNEL, INT4, INT4_SYM)
ALL_FAMILIES: dict[str, WeightFormat] = {"nvfp4": NVFP4, "fp8": FP8_TENSOR, "int4": INT4}
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


def weight_format(name_or_algo: Any, fp8_scale: str | None = None, served_only: bool = True) -> WeightFormat:
    """The WeightFormat named; ``fp8_scale`` ("tensor" | "channel") picks the FP8 member."""
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
    if fp8_scale is not None and len(members) > 1:
        f = members.get(fp8_scale)
        if f is None:
            raise UnknownFormat(f"unknown {name_or_algo!s} scale layout {fp8_scale!r}; expected "
                                + " or ".join(repr(k) for k in members))
    return f


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

