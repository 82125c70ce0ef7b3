"""The type every weight format is an instance of (``WeightFormat``), the errors of the format
layer, and the constants its fields are checked against. The formats themselves are data of their
families (kernels/families/<family>/members.py); kernels/formats.py gathers them and answers
lookups. This module is the bottom of kernels/: it imports nothing of the package and no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

ATOMS = ("m8n8k4", "m16n8k16")


class FormatError(ValueError):
    """A tensor does not have the shape or dtype its format requires."""


def require(cond: bool, msg: str) -> None:
    """Raise FormatError(msg) unless ``cond``: how codecs and layouts refuse a malformed tensor."""
    if not cond:
        raise FormatError(msg)


def symbol_shape(symbols, n: int, k: int, g: int = 0, p: int = 1, parts: int = 1) -> tuple[int, ...]:
    """The shape a stored tensor's symbols give: "N" / "K" the module's outputs / inputs, "N/8" or
    "K/p" one value per that many (rounded up; "p": ``p``, values per int32 word), "K/g" one per
    group of ``g`` (one in all where g <= 0: per channel), "P" one per fused shard, a number itself.
    (The loader schemas' StoredTensor and the integer conventions' StoredLayout read theirs so.)"""
    out = []
    for sym in symbols:
        if sym == "P":
            out.append(parts)
        elif sym.isdigit():
            out.append(int(sym))
        else:
            axis, _, div = sym.partition("/")
            size = {"N": n, "K": k}[axis]
            if div == "g" and g <= 0:
                out.append(1)
                continue
            d = g if div == "g" else p if div == "p" else int(div or 1)
            out.append(-(-size // d))
    return tuple(out)


def symbol_n_k(symbols, shape, p: int = 1) -> tuple[int, int] | None:
    """(N, K) of a module from its codes tensor's ``shape`` and symbols (the inverse of
    symbol_shape for "N", "K", "N/<d>", "K/<d>"); None if the ranks differ."""
    if len(shape) != len(symbols):
        return None
    got: dict[str, int] = {}
    for sym, size in zip(symbols, shape):
        axis, _, div = sym.partition("/")
        got[axis] = int(size) * (p if div == "p" else int(div or 1))
    return got["N"], got["K"]


class ActOrderError(FormatError):
    """A GPTQ / compressed-tensors g_idx that reorders inputs within groups (desc_act): the kernels
    read inputs in checkpoint order, so such a weight cannot be served as stored. Every integer
    family's apply_g_idx raises it."""


class UnknownFormat(FormatError):
    """A format name, quant algo or route that names no QPN weight format."""


class MoeShapeError(ValueError):
    """Expert tensors or routing tensors of the wrong shape, dtype or device."""


class M8N8K4Kernel(NamedTuple):
    """One dense m8n8k4 kernel of a format and what instantiates it in csrc/qpn_kernels.cu
    (kernels/jit.py writes its entry line from this before NVRTC compiles the file)."""
    name: str      # the entry point
    decoder: str   # the decoder struct (its family's m8n8k4.cuh) it is instantiated with
    tiles: int     # 8-token tiles per weight pass; 0: the workspace reconstruction pass


class KernelEntry(NamedTuple):
    """One entry line of a kernel source, as a family's data holds it: ``MACRO(name, decoder,
    args...)`` (kernels/jit.py writes the line into the source as NVRTC compiles it)."""
    macro: str                  # the entry macro of the source (QPN80_ENTRY, QPN80R_ENTRY, ...)
    name: str                   # the entry point
    decoder: str                # the decoder / fragment struct it is instantiated with
    args: tuple = ()            # the macro's further arguments, in its order (numbers, or words: true)

    @property
    def line(self) -> str:
        return f"{self.macro}({', '.join([self.name, self.decoder, *map(str, self.args)])})"


@dataclass(frozen=True)
class WeightFormat:
    key: str               # unique name of this description
    family: str            # kernel family: its package kernels/families/<family>/, census region, route family
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
    # the decoder struct (kernels/families/<family>/m8n8k4.cuh) the member's m8n8k4 kernels are instantiated with
    # (required with the m8n8k4 atom), and that of the S7 form of its tiled kernels, where its group
    # scale can carry 2^7 ("": no S7 form; ops.nvfp4_form)
    decoder: str = ""
    s7_decoder: str = ""
    # "int": unsigned integer codes less a zero point, times a group scale (the integer conventions,
    # GPTQ / AWQ / compressed-tensors pack-quantized, store them packed in int32 words); "float": minifloat codes
    code_type: str = "float"
    # a checkpoint may store one group per output row (group_size -1, strategy "channel") besides group_sizes
    channel_groups: bool = False

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
    def code_bits(self) -> int:
        """Bits per code (8 // codes_per_byte)."""
        return 8 // self.codes_per_byte

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
        group scales (plus zero points, each as wide as a code: a nibble beside 4-bit codes, a
        byte beside 8-bit ones)."""
        if not self.group_size:
            return 1 / self.codes_per_byte
        scale_bytes = 2 if self.scale_dtype in ("float16", "bfloat16") else 1
        zero_bytes = self.has_zero_points / self.codes_per_byte
        return 1 / self.codes_per_byte + (scale_bytes + zero_bytes) / self.group_size

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


# Largest finite magnitudes of the two minifloats the families store (number formats, not families).
E2M1_MAX = 6.0
E4M3_MAX = 448.0
