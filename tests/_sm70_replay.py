"""Lane-level CPU replay of the m8n8k4 (SM70) QPN kernels, built from the CUDA source itself.

The replay does not read kernels/atoms.py. It takes its rules from two places only:

* the CUDA sources (kernels/csrc/qpn_family.cuh, the families' m8n8k4.cuh, qpn_kernels.cu,
  qpn_moe.cu): the small rule
  functions (AtomM8N8K4::b_token / a_row / acc_row / acc_token / scale_pair_offset / b_frag, the
  decoders DecNVFP4 / DecFP8 and the bit helpers they call) and the constants of those structs are
  PARSED out of the source text and evaluated in Python on the real packed bytes, and the main
  loops' per-step expressions (activation offset, which group scale, which decoded register goes
  to a0 / a1, how many words a step consumes) are parsed out of the kernel bodies; an edit to any
  of those in the .cuh / .cu changes what the replay computes;
* the PTX ISA (section "Matrix Fragments for mma.m8n8k4 with .f16 floating point type"), written
  down here independently of both atoms.py and qpn_family.cuh: which lanes form each of the four
  MMA computations, where a row-major A / column-major B element sits, and where the eight f32
  accumulators of a lane sit in the 8x8 result.

The control flow around those rules (the k-block loop with its split-K stride, the block / warp /
tile arithmetic, the epilogue's split-K sum and output indexing, the MoE group table) is
transcribed from the kernel bodies by hand and says so where it does.

What each lane loads (its LANE_BYTES slice of every packed (tile, k-block), its 16-bit scale pair,
its activation halves), what the decoder turns that into, and what each MMA receives are computed
exactly as the kernel would, with FP16 multiplies rounded as mul.rn.f16x2 rounds (and every such
rounding recorded: the decoders claim there is none). The products are then summed in float64,
so a replay that follows the right layout equals the float64 reference of the CHECKPOINT tensors
(not of the packed buffers) to ~1e-15 relative, and a layout error anywhere gives an O(1) error.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from qpn.kernels import jit
from qpn.kernels.families.fp8 import codec as fp8_codec

CSRC = Path(__file__).resolve().parents[1] / "kernels" / "csrc"
M32 = 0xFFFFFFFF


class ReplayParseError(AssertionError):
    """The CUDA source no longer has the shape this replay reads; update tests/_sm70_replay.py."""


# ------------------------------------------------------------------------------ u32 values
class U32:
    """A tensor of 32-bit unsigned words (held in int64) with C's u32 wrap-around on every op."""

    __slots__ = ("v",)

    def __init__(self, v):
        self.v = (v & M32) if isinstance(v, int) else torch.as_tensor(v, dtype=torch.int64) & M32

    @staticmethod
    def _o(x):
        return x.v if isinstance(x, U32) else x

    def __lshift__(self, s): return U32((self.v << self._o(s)) & M32)
    def __rshift__(self, s): return U32(self.v >> self._o(s))
    def __and__(self, o): return U32(self.v & self._o(o))
    __rand__ = __and__
    def __or__(self, o): return U32(self.v | self._o(o))
    __ror__ = __or__
    def __xor__(self, o): return U32(self.v ^ self._o(o))
    __rxor__ = __xor__
    def __add__(self, o): return U32(self.v + self._o(o))
    __radd__ = __add__


def _as_u32(x) -> U32:
    return x if isinstance(x, U32) else U32(int(x))


def _half_bits_to_f64(bits: torch.Tensor) -> torch.Tensor:
    b = torch.where(bits >= 0x8000, bits - 0x10000, bits)
    return b.to(torch.int16).view(torch.float16).double()


def _f64_to_half_bits(v: torch.Tensor) -> torch.Tensor:
    return v.half().view(torch.int16).to(torch.int64) & 0xFFFF


def h2(x) -> tuple[torch.Tensor, torch.Tensor]:
    """f16x2 register -> (low half, high half) as float64."""
    x = _as_u32(x).v
    if isinstance(x, int):
        x = torch.tensor(x, dtype=torch.int64)
    return _half_bits_to_f64(x & 0xFFFF), _half_bits_to_f64((x >> 16) & 0xFFFF)


class PTX:
    """The PTX instructions behind qpn_ptx.cuh's one-line wrappers, by their ISA semantics."""

    roundings = 0      # FP16 multiplies that rounded (the decoders claim none do)

    @staticmethod
    def and_or(a, m, b):            # lop3.b32 d, a, m, b, 0xEA: (a & m) | b
        return (_as_u32(a) & _as_u32(m)) | _as_u32(b)

    @staticmethod
    def shl_b32(a, s):              # shl.b32 (shifts here are < 32)
        return _as_u32(a) << s

    @staticmethod
    def shr_b32(a, s):              # shr.b32: logical
        return _as_u32(a) >> s

    @staticmethod
    def and_b32(a, m):
        return _as_u32(a) & _as_u32(m)

    @staticmethod
    def or_and(a, b, m):            # lop3.b32 d, a, b, m, 0xA8: (a | b) & m
        return (_as_u32(a) | _as_u32(b)) & _as_u32(m)

    @staticmethod
    def prmt(a, b, sel):            # prmt.b32 (default mode): byte i of d = byte sel_i of {b, a}
        a, b = _as_u32(a).v, _as_u32(b).v
        out = 0
        for i in range(4):
            n = (sel >> (4 * i)) & 0xF
            byte = ((a if n < 4 else b) >> (8 * (n & 3))) & 0xFF
            if n & 8:                                    # sign-replicate mode of that byte
                byte = torch.where(byte >= 0x80, 0xFF, 0) if isinstance(byte, torch.Tensor) else (0xFF if byte >= 0x80 else 0)
            out = out | (byte << (8 * i))
        return U32(out)

    @classmethod
    def hsub2(cls, a, b):           # sub.rn.f16x2: each half subtracted, rounded to nearest even
        (al, ah), (bl, bh) = h2(a), h2(b)
        out = []
        for x, y in ((al, bl), (ah, bh)):
            d = x - y                                   # exact in float64
            cls.roundings += int((d.half().double() != d).sum())
            out.append(_f64_to_half_bits(d))
        return U32(out[0] | (out[1] << 16))

    @classmethod
    def hmul2(cls, a, b):           # mul.rn.f16x2: each half multiplied, rounded to nearest even
        (al, ah), (bl, bh) = h2(a), h2(b)
        out = []
        for x, y in ((al, bl), (ah, bh)):
            p = x * y                                   # exact in float64
            r = p.half().double()
            cls.roundings += int((r != p).sum())
            out.append(_f64_to_half_bits(p))
        return U32(out[0] | (out[1] << 16))


_PTX_FUNCS = {name: getattr(PTX, name) for name in ("and_or", "hmul2", "shl_b32", "shr_b32", "and_b32", "or_and",
                                                   "prmt", "hsub2")}


# ------------------------------------------------------------------ C rule functions -> Python
def _strip_comments(src: str) -> str:
    src = re.sub(r"/\*.*?\*/", " ", src, flags=re.S)
    return re.sub(r"//[^\n]*", "", src)


def _match(src: str, i: int, open_c: str, close_c: str) -> int:
    """Index just past the bracket that closes the one at src[i]."""
    depth = 0
    for j in range(i, len(src)):
        if src[j] == open_c:
            depth += 1
        elif src[j] == close_c:
            depth -= 1
            if depth == 0:
                return j + 1
    raise ReplayParseError(f"unbalanced {open_c}{close_c} at {i}")


def _struct_body(src: str, name: str) -> str:
    m = re.search(r"struct\s+" + name + r"\s*\{", src)
    if not m:
        raise ReplayParseError(f"struct {name} not found in the CUDA source")
    start = m.end() - 1
    return src[start + 1: _match(src, start, "{", "}") - 1]


def _split_top(e: str, sep: str) -> list:
    parts, depth, last = [], 0, 0
    for i, ch in enumerate(e):
        depth += (ch in "([") - (ch in ")]")
        if ch == sep and depth == 0:
            parts.append(e[last:i])
            last = i + 1
    return parts + [e[last:]]


def _ternary(e: str) -> str:
    """C 'a ? b : c' anywhere in an expression (inner parenthesised groups and call arguments
    first) -> Python '((b) if (a) else (c))'."""
    out, i = [], 0
    while i < len(e):
        if e[i] == "(":
            j = _match(e, i, "(", ")")
            out.append("(" + ", ".join(_ternary(p) for p in _split_top(e[i + 1:j - 1], ",")) + ")")
            i = j
        else:
            out.append(e[i])
            i += 1
    e = "".join(out)
    depth, q = 0, -1
    for i, ch in enumerate(e):
        depth += (ch in "([") - (ch in ")]")
        if ch == "?" and depth == 0:
            q = i
            break
    if q < 0:
        return e
    depth = 0
    for i in range(q + 1, len(e)):
        ch = e[i]
        depth += (ch in "([") - (ch in ")]")
        if ch == ":" and depth == 0:
            return f"(({e[q + 1:i].strip()}) if ({e[:q].strip()}) else ({_ternary(e[i + 1:]).strip()}))"
    raise ReplayParseError(f"unmatched ?: in {e!r}")


def c_expr(e: str) -> str:
    """One C expression of the kernels' subset -> Python."""
    e = re.sub(r"\b(0[xX][0-9A-Fa-f]+|\d+)[uU]\b", r"\1", e)
    e = re.sub(r"\b(\d+\.\d*)[fF]\b", r"\1", e)
    e = re.sub(r"\((?:u32|int|size_t|unsigned)\)", "", e)
    e = re.sub(r"(\w+)::", r"\1.", e)
    e = re.sub(r"(?<![/])/(?![/])", "//", e)          # the rules divide ints only
    e = e.replace("true", "True").replace("false", "False").replace("&&", " and ").replace("||", " or ")
    return _ternary(e.strip())


@dataclass
class CFunc:
    name: str
    params: list
    body: str


def _functions(body: str) -> dict:
    """QPN_DEV functions with a straight-line body (no nested braces, no asm) of a struct or file."""
    out = {}
    for m in re.finditer(r"QPN_DEV\s+(?:static\s+)?[\w ]+?\s(\w+)\s*\(", body):
        name = m.group(1)
        p0 = m.end() - 1
        p1 = _match(body, p0, "(", ")")
        rest = body[p1:].lstrip()
        if not rest.startswith("{"):
            continue
        b0 = body.index("{", p1)
        b1 = _match(body, b0, "{", "}")
        text = body[b0 + 1: b1 - 1]
        if "{" in text or "asm" in text:
            continue
        params = []
        for p in body[p0 + 1: p1 - 1].split(","):
            p = p.strip()
            if not p:
                continue
            mm = re.search(r"\(&(\w+)\)", p) or re.search(r"(\w+)\s*$", p)
            params.append(mm.group(1))
        out[name] = CFunc(name, params, text)
    return out


def _constants(body: str) -> dict:
    return {m.group(1): m.group(2) for m in re.finditer(r"static\s+constexpr\s+(?:int|bool|float)\s+(\w+)\s*=\s*([^;]+);", body)}


def _compile(fn: CFunc, ns: dict):
    """A CFunc -> a Python function evaluated in ns (declarations, assignments, one return)."""
    lines, assigned = [], []
    for stmt in fn.body.split(";"):
        stmt = stmt.strip()
        if not stmt:
            continue
        if stmt.startswith("return "):
            lines.append("return " + c_expr(stmt[len("return "):]))
            continue
        m = re.fullmatch(r"(?:const\s+)?(?:u32|int|float)\s+(\w+)\s*=\s*(.+)", stmt, flags=re.S) or \
            re.fullmatch(r"(\w+)\s*=\s*(.+)", stmt, flags=re.S)
        if not m:
            raise ReplayParseError(f"{fn.name}: statement the replay cannot read: {stmt!r}")
        lines.append(f"{m.group(1)} = {c_expr(m.group(2))}")
        assigned.append(m.group(1))
    if not lines[-1].startswith("return"):
        lines.append("return {" + ", ".join(f"{a!r}: {a}" for a in assigned) + "}")   # void, out-params
    src = f"def {fn.name}({', '.join(fn.params)}):\n" + "\n".join("    " + ln for ln in lines)
    exec(src, ns)                                           # noqa: S102 (our own repo's source)
    return ns[fn.name]


def _compile_or_stub(fn: CFunc, ns: dict) -> None:
    """Compile fn; one the replay cannot read (loops, templates it does not use) becomes a stub
    that fails with the reason if the replay ever calls it."""
    try:
        _compile(fn, ns)
    except (ReplayParseError, SyntaxError) as e:
        def stub(*_a, _e=e, _n=fn.name):
            raise ReplayParseError(f"{_n} is used by the replay but could not be read: {_e}")
        ns[fn.name] = stub


def load_rules(family_src: str | None = None) -> SimpleNamespace:
    """The m8n8k4 atom (qpn_family.cuh) and the families' decoders (jit.decoder_source), as Python callables and ints. The NVFP4
    decoder is a template (DecNVFP4Form<bool S7>); each ``using NAME = DecNVFP4Form<...>;`` line
    gives one decoder, its body evaluated with that S7."""
    src = _strip_comments(family_src if family_src is not None else jit.decoder_source("m8n8k4"))
    glob = {**_PTX_FUNCS, "True": True, "False": False}
    top = src
    for s in ("AtomM8N8K4", "DecNVFP4Form", "DecFP8", "DecINT4Form"):
        top = top.replace(_struct_body(src, s), "")
    for f in _functions(top).values():
        _compile_or_stub(f, glob)
    forms = {m.group(1): m.group(2) == "true"
             for m in re.finditer(r"using\s+(\w+)\s*=\s*DecNVFP4Form<\s*(true|false)\s*>\s*;", src)}
    if set(forms) != {"DecNVFP4", "DecNVFP4S7"}:
        raise ReplayParseError(f"qpn_family.cuh names the NVFP4 decoder forms {sorted(forms)}; the replay "
                               "reads DecNVFP4 and DecNVFP4S7 (DecNVFP4Form<false / true>)")
    int4 = {m.group(1): m.group(2) == "true"
            for m in re.finditer(r"using\s+(\w+)\s*=\s*DecINT4Form<\s*(true|false)\s*>\s*;", src)}
    if set(int4) != {"DecINT4", "DecINT4Sym"} or set(int4.values()) != {False, True}:
        raise ReplayParseError(f"qpn_family.cuh names the INT4 decoder forms {sorted(int4)}; the replay "
                               "reads DecINT4 and DecINT4Sym (DecINT4Form<false / true>)")
    structs = {}
    for name, s, extra in ([("AtomM8N8K4", "AtomM8N8K4", {}), ("DecFP8", "DecFP8", {})]
                           + [(n, "DecNVFP4Form", {"S7": v}) for n, v in forms.items()]
                           + [(n, "DecINT4Form", {"SYM": v}) for n, v in int4.items()]):
        body = _struct_body(src, s)
        ns = {**glob, **extra}
        for k, v in _constants(body).items():
            ns[k] = eval(c_expr(v), ns)                     # noqa: S307 (constants like K_BLOCK / K_STEP)
        for f in _functions(body).values():
            _compile_or_stub(f, ns)
        structs[name] = SimpleNamespace(**{k: v for k, v in ns.items() if not k.startswith("__")})
    return SimpleNamespace(atom=structs["AtomM8N8K4"], nvfp4=structs["DecNVFP4"], nvfp4_s7=structs["DecNVFP4S7"],
                           fp8=structs["DecFP8"], int4=structs["DecINT4"], int4_sym=structs["DecINT4Sym"],
                           decoders=structs)


@dataclass
class LoopRules:
    """Per-step expressions of a kernel main loop, parsed from its body."""
    x_offset: str      # activation offset of pair p in k-block kb (halves)
    scale_pick: str    # which sc2 entry scales pair p
    a0: str            # front_half2 index of a0 for MMA j of the pair
    a1: str
    rotate: str        # words dropped after each pair
    scale_lo: str      # sc2[0] from sp2 = Dec::scale_pair(the lane's 16-bit scale pair)
    scale_hi: str
    pairs: str         # pairs per k-block


def load_loop(body_src: str, what: str) -> LoopRules:
    s = _strip_comments(body_src)

    def one(pattern):
        m = re.search(pattern, s)
        if not m:
            raise ReplayParseError(f"{what}: the main loop no longer matches {pattern!r}; update the replay")
        return m.group(1).strip()

    def x_offset():
        # either load_x(xrow + OFFSET, ...) per pair (the MoE loop), or a pointer per token tile:
        # xnext[t] = xrow + INIT before the k-block loop, xk[t] = xnext[t] and xnext[t] += KSTEP
        # per k-block (k-blocks ks, ks + ksplit, ...: transcribed), load_x(xk[t], ...) reads and
        # xk[t] += PSTEP advances per pair
        if re.search(r"Atom::load_x\(xrow", s):
            return one(r"Atom::load_x\(xrow(?:\[t\])?\s*\+\s*([^,]+),")
        ptr = one(r"Atom::load_x\((\w+)\[t\],")
        nxt = one(ptr + r"\[t\]\s*=\s*(\w+)\[t\];")
        init = one(nxt + r"\[t\]\s*=\s*xrow\s*\+\s*([^;]+);")
        kstep = one(nxt + r"\[t\]\s*\+=\s*([^;]+);")
        pstep = one(ptr + r"\[t\]\s*\+=\s*([^;]+);")
        return f"({init}) + ((kb - ks) // a.ksplit) * ({kstep}) + p * ({pstep})"

    one(r"(const u32 sp2\s*=\s*Dec::scale_pair\()")
    return LoopRules(
        x_offset=x_offset(),
        scale_pick=one(r"const u32 s\s*=\s*([^;]+);"),
        a0=one(r"u32 a0\s*=\s*Dec::front_half2\(w,\s*([^)]+)\);"),
        a1=one(r"u32 a1\s*=\s*Dec::front_half2\(w,\s*([^)]+)\);"),
        rotate=one(r"rotate_words<([^>]+)>\(w\)"),
        scale_lo=one(r"sc2\[0\]\s*=\s*([^;]+);"),
        scale_hi=one(r"sc2\[1\]\s*=\s*([^;]+);"),
        pairs=one(r"constexpr int PAIRS\s*=\s*([^;]+);"),
    )


def kernel_body(file: str, name: str) -> str:
    src = (CSRC / file).read_text()
    m = re.search(r"__device__\s+__forceinline__\s+void\s+" + name + r"\s*\(", src)
    if not m:
        raise ReplayParseError(f"{name} not found in {file}")
    b0 = src.index("{", m.end())
    return src[b0: _match(src, b0, "{", "}")]


def entry_points(file: str, macro: str) -> dict:
    """NAME -> (atom struct, decoder struct, template argument) from the entry-point macro lines of
    the source as NVRTC compiles it (qpn_kernels.cu: with the lines jit writes from the formats)."""
    src = _strip_comments(jit.kernel_sources()[file])
    return {m.group(1): (m.group(2), m.group(3), m.group(4))
            for m in re.finditer(macro + r"\((\w+),\s*(\w+),\s*(\w+),\s*(\w+)\)", src)}


# ------------------------------------------------------------------------- PTX m8n8k4 model
# PTX ISA, "Matrix Fragments for mma.m8n8k4 with .f16 floating point type" (.row A, .col B, .f32 C/D):
#   MMA computation q (0..3) is done by lanes 4q..4q+3 (low group) and 4q+16..4q+19 (high group);
#   A (row-major): lane holds a0..a3 = row (lane % 4) + 4 * (lane >= 16), columns 0..3;
#   B (column-major): lane holds b0..b3 = rows 0..3 of column (lane % 4) + 4 * (lane >= 16);
#   C/D (.f32): lane's c_i is row X + 4 * (lane >= 16), X = (lane & 1) + (i & 2),
#               column (i & 4) + (lane & 2) + (i & 1).
def ptx_quadpair_lanes(q: int) -> list[int]:
    return [4 * q + i for i in range(4)] + [4 * q + 16 + i for i in range(4)]


def ptx_a_row(lane: int) -> int:
    return lane % 4 + (4 if lane >= 16 else 0)


def ptx_b_col(lane: int) -> int:
    return lane % 4 + (4 if lane >= 16 else 0)


def ptx_c_pos(lane: int, i: int) -> tuple[int, int]:
    return (lane & 1) + (i & 2) + (4 if lane >= 16 else 0), (i & 4) + (lane & 2) + (i & 1)


# Lane -> (MMA computation, A row / B column) per the PTX table above, as index tensors.
_LANES = range(32)
_Q = torch.tensor([next(q for q in range(4) if lane in ptx_quadpair_lanes(q)) for lane in _LANES])
_AROW = torch.tensor([ptx_a_row(lane) for lane in _LANES])
_BCOL = torch.tensor([ptx_b_col(lane) for lane in _LANES])
assert len({(int(q), int(r)) for q, r in zip(_Q, _AROW)}) == 32   # each (computation, row) one lane
_CQ = _Q.unsqueeze(1).expand(32, 8)
_CR = torch.tensor([[ptx_c_pos(lane, i)[0] for i in range(8)] for lane in _LANES])
_CC = torch.tensor([[ptx_c_pos(lane, i)[1] for i in range(8)] for lane in _LANES])


def mma_m8n8k4(a: tuple, b: tuple) -> torch.Tensor:
    """The four MMA computations of one mma.m8n8k4 over a batch: a = (a0 lo, a0 hi, a1 lo, a1 hi),
    each float64 [..., K, 32 lanes]; b = (b0 lo, b0 hi, b1 lo, b1 hi), each [K, 32]. The lanes'
    elements are placed by the PTX fragment layout; returns D [..., 4, 8, 8] summed over K (the
    accumulator's sum over the warp's k-blocks), in float64."""
    av = torch.stack(a, -1)                                    # [..., K, 32, 4]
    A = torch.zeros(av.shape[:-2] + (4, 8, 4), dtype=torch.float64)
    A[..., _Q, _AROW, :] = av                                  # A[q][row][k-col]
    bv = torch.stack(b, -1)                                    # [K, 32, 4]
    Bt = torch.zeros((bv.shape[0], 4, 8, 4), dtype=torch.float64)
    Bt[:, _Q, _BCOL, :] = bv                                   # B^T[q][col][k-row]
    return (A @ Bt.transpose(-1, -2)).sum(-4)


def lane_accumulators(d: torch.Tensor) -> torch.Tensor:
    """D [..., 4, 8, 8] -> the accumulators [..., 32 lanes, 8] where PTX puts c_i of each lane."""
    return d[..., _CQ, _CR, _CC]


# -------------------------------------------------------------------------- the dense kernel
def _words(raw: torch.Tensor) -> torch.Tensor:
    b = raw.to(torch.int64).reshape(*raw.shape[:-1], -1, 4)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


class _Pointer:
    """A device pointer the epilogue reads with ldgf: pointer + index -> the element(s) there."""

    def __init__(self, t: torch.Tensor):
        self.t = t

    def __add__(self, idx):
        return self.t[idx]


class Replay:
    """The m8n8k4 kernels of the current source tree (or of given source texts). All 32 lanes are
    replayed at once (a lane index is the last tensor dimension); each lane's values come from
    that lane's own addresses and rules."""

    def __init__(self, family_src: str | None = None, kernels_src: str | None = None, moe_src: str | None = None,
                 recon_src: str | None = None):
        self.r = load_rules(family_src)
        ksrc = kernels_src if kernels_src is not None else kernel_body("qpn_kernels.cu", "qpn_linear_body")
        msrc = moe_src if moe_src is not None else kernel_body("qpn_moe.cu", "qpn_moe_gemm_body")
        self.dense_loop = load_loop(ksrc, "qpn_linear_body")
        self._ksrc = ksrc
        self._rsrc = recon_src if recon_src is not None else kernel_body("qpn_kernels.cu", "qpn_reconstruct_body")
        self._int4 = None
        self.moe_loop = load_loop(msrc, "qpn_moe_gemm_body")
        m = re.search(r"v \*= (ldgf\(a\.chscale \+ [^;]+);", _strip_comments(ksrc))
        if m is None:
            raise ReplayParseError("qpn_linear_body: the epilogue no longer applies the FP32 result scale "
                                   "(v *= ldgf(a.chscale + ...)...); update the replay if that is intended")
        self.dense_scale = m.group(1)   # evaluated per output row: a.chscale is the scale tensor
        ms = _strip_comments(msrc)
        m = re.search(r"const int cidx\s*=\s*([^;]+);", ms)
        if m is None or "v *= ldgf(a.chscale[0] + cidx)" not in ms or "u *= ldgf(a.chscale[1] + cidx)" not in ms:
            raise ReplayParseError("qpn_moe_gemm_body: the epilogue no longer scales gate (chscale[0]) and up "
                                   "(chscale[1]) by the expert's FP32 result scale at cidx")
        self.moe_scale_index = m.group(1)
        ds = _strip_comments(ksrc)

        def grab(src, pattern, what):
            mm = re.search(pattern, src)
            if mm is None:
                raise ReplayParseError(f"{what}: no longer matches {pattern!r}; update the replay")
            return mm.group(1)
        # which tile a warp streams and which tokens its lanes load (parsed, evaluated per warp / lane)
        self.dense_tile = grab(ds, r"const int tile\s*=\s*([^;]+);", "qpn_linear_body tile")
        self.dense_m0 = grab(ds, r"const int m0\s*=\s*([^;]+);", "qpn_linear_body m0")
        self.dense_tok = grab(ds, r"const int tok\s*=\s*([^;]*b_token\(lane\)[^;]*);", "qpn_linear_body token")
        self.moe_half = grab(ms, r"const int half\s*=\s*([^;]+);", "qpn_moe_gemm_body half")
        self.moe_which = grab(ms, r"const int which\s*=\s*([^;]+);", "qpn_moe_gemm_body which")
        self.moe_tile = grab(ms, r"const int tile\s*=\s*([^;]+);", "qpn_moe_gemm_body tile")
        self.moe_col = grab(ms, r"const int col\s*=\s*([^;]+);", "qpn_moe_gemm_body col")
        self.recon_pick = re.search(r"hmul2\(h\[idx\],\s*sc2\[([^\]]+)\]\)",
                                    _strip_comments((CSRC / "qpn_kernels.cu").read_text()))
        if self.recon_pick is None:
            raise ReplayParseError("qpn_reconstruct_body: the group-scale pick hmul2(h[idx], sc2[...]) is gone")
        at = self.r.atom
        self.lane_b_token = [at.b_token(lane) for lane in _LANES]
        self.lane_scale_off = torch.tensor([at.scale_pair_offset(lane) for lane in _LANES])
        self.lane_acc_token = torch.tensor([[at.acc_token(lane, i) for i in range(at.ACC)] for lane in _LANES])
        self.lane_acc_row = torch.tensor([[at.acc_row(lane, i) for i in range(at.ACC)] for lane in _LANES])
        self.lane_a_row = torch.tensor([at.a_row(lane) for lane in _LANES])

    _codes: dict = {}

    def _ev(self, expr: str, dec, **vars_):
        code = self._codes.get(expr)
        if code is None:
            code = self._codes[expr] = compile(c_expr(expr), f"<cuda: {expr}>", "eval")
        return eval(code, {"Atom": self.r.atom, "Dec": dec, **vars_})   # noqa: S307

    def _dec(self, fmt):
        return self.r.nvfp4 if fmt == "nvfp4" else self.r.fp8

    # ---------------------------------------------------------------- INT4 group records (parsed)
    def int4_rules(self) -> SimpleNamespace:
        """The INT4 record addressing and operand finish of qpn_linear_body and qpn_reconstruct_body,
        parsed (on first use, so that the NVFP4 / FP8 drift tests never depend on them)."""
        if self._int4 is None:
            ds, rs = _strip_comments(self._ksrc), _strip_comments(self._rsrc)

            def grab(src, pattern, what):
                mm = re.search(pattern, src)
                if mm is None:
                    raise ReplayParseError(f"{what}: no longer matches {pattern!r}; update the replay")
                return mm.groups() if len(mm.groups()) > 1 else mm.group(1)
            self._int4 = SimpleNamespace(
                groups_pad=grab(ds, r"const int groups_pad\s*=\s*([^;]+);", "qpn_linear_body groups_pad"),
                rbase=grab(ds, r"rbase\s*=\s*a\.scales\s*\+\s*([^;]+);", "qpn_linear_body rbase"),
                rec_first=grab(ds, r"spq\[d\]\s*=\s*Dec::record\(rbase\s*\+\s*([^;]+)\);", "ring prologue record"),
                rec_next=grab(ds, r"spq\[AHEAD - 1\]\s*=\s*Dec::record\(rbase\s*\+\s*([^;]+)\);", "ring record"),
                zb=grab(ds, r"zb\s*=\s*Dec::(\w+)\(spq\[0\]\);", "qpn_linear_body zero bias"),
                sg=grab(ds, r"sg\s*=\s*Dec::(\w+)\(spq\[0\]\);", "qpn_linear_body group scale"),
                a0=grab(ds, r"a0\s*=\s*Dec::apply\(a0,\s*(\w+),\s*(\w+)\);", "qpn_linear_body apply a0"),
                a1=grab(ds, r"a1\s*=\s*Dec::apply\(a1,\s*(\w+),\s*(\w+)\);", "qpn_linear_body apply a1"),
                r_groups_pad=grab(rs, r"const int groups_pad\s*=\s*([^;]+);", "qpn_reconstruct_body groups_pad"),
                r_rec=grab(rs, r"const u32 rec\s*=\s*Dec::record\(scales\s*\+\s*([^;]+)\);", "reconstruct record"),
                r_zb=grab(rs, r"zb\s*=\s*Dec::(\w+)\(rec\);", "qpn_reconstruct_body zero bias"),
                r_sg=grab(rs, r"sg\s*=\s*Dec::(\w+)\(rec\);", "qpn_reconstruct_body group scale"),
                r_apply=grab(rs, r"h\[idx\]\s*=\s*Dec::apply\(h\[idx\],\s*(\w+),\s*(\w+)\);", "reconstruct apply"))
        return self._int4

    @staticmethod
    def _group_shift(packed) -> int:
        kpg = packed.group_size // 32
        return kpg.bit_length() - 1

    def _int4_records(self, packed, dec, offsets: torch.Tensor) -> U32:
        """The REC_BYTES-byte little-endian records at byte ``offsets`` of the packed records (an
        address past the buffer is an IndexError, as it would be a fault)."""
        buf = packed.scales.to(torch.int64)
        v = torch.zeros_like(offsets)
        for i in range(dec.REC_BYTES):
            v = v | (buf[offsets + i] << (8 * i))
        return U32(v)

    def int4_lane_records(self, packed, dec, n_tiles: int, kblocks: int, ksplit: int, mt: int) -> U32:
        """The record every lane of every (tile, k-block) loads, from the parsed addresses (the ring's
        prologue form; its in-loop form must name the same bytes for every k-block it loads)."""
        ru = self.int4_rules()
        shift = self._group_shift(packed)
        args = SimpleNamespace(kblocks=kblocks, group_shift=shift, ksplit=ksplit, scales=0)
        gp = self._ev(ru.groups_pad, dec, a=args)
        tile = torch.arange(n_tiles).reshape(-1, 1, 1)
        lane = torch.arange(32).reshape(1, 1, -1)
        kb = torch.arange(kblocks).reshape(1, -1, 1)
        base = self._ev(ru.rbase, dec, a=args, tile=tile, lane=lane, groups_pad=gp)
        first = base + self._ev(ru.rec_first, dec, a=args, ks=kb, d=0)
        ahead = dec.KBLOCKS_AHEAD if mt == 1 else dec.KBLOCKS_AHEAD_MT2
        if kblocks > ahead * ksplit:
            prev = torch.arange(kblocks - ahead * ksplit).reshape(1, -1, 1)
            nxt = base + self._ev(ru.rec_next, dec, a=args, kb=prev, AHEAD=ahead)
            assert torch.equal(nxt.expand(n_tiles, -1, 32), first[:, ahead * ksplit:].expand(n_tiles, -1, 32)), \
                "the ring's in-loop record load and its prologue name different records"
        return self._int4_records(packed, dec, first.expand(n_tiles, kblocks, 32))

    def int4_lane_operands(self, codes_blk, rec: U32, dec):
        """As lane_operands, for the INT4 decoder: each register finished by Dec::apply with the
        k-block's record (zero bias, group scale), in the argument order the loop passes them."""
        ru, loop = self.int4_rules(), self.dense_loop
        raw = codes_blk.reshape(*codes_blk.shape[:-1], 32, dec.WORDS * 4)
        w = [U32(t) for t in _words(raw).unbind(-1)]
        named = {"zb": getattr(dec, ru.zb)(rec), "sg": getattr(dec, ru.sg)(rec)}
        pairs = self._ev(loop.pairs, dec)
        regs = {}
        for p in range(pairs):
            for j in range(2):
                a0 = dec.apply(dec.front_half2(w, self._ev(loop.a0, dec, j=j)), *(named[v] for v in ru.a0))
                a1 = dec.apply(dec.front_half2(w, self._ev(loop.a1, dec, j=j)), *(named[v] for v in ru.a1))
                regs[(p, j)] = h2(a0) + h2(a1)
            n = self._ev(loop.rotate, dec)
            w = [w[i + n] if i + n < len(w) else U32(0) for i in range(len(w))]
        return regs, pairs

    def _load(self, fmt, codes_blk, scales_blk, loop, dec=None):
        """What every lane loads per (tile, k-block): its WORDS code words (cptr + lane *
        LANE_BYTES, little-endian) and (NVFP4) its two decoded group scales (ldg16 at
        scale_pair_offset(lane)). ``dec``: the decoder struct (default: the format's restore form)."""
        dec = dec or self._dec(fmt)
        lane_bytes = dec.WORDS * 4
        raw = codes_blk.reshape(*codes_blk.shape[:-1], 32, lane_bytes)   # lane l: bytes l*LANE_BYTES ..
        w = [U32(t) for t in _words(raw).unbind(-1)]                     # [T, KB, 32] each
        sc2 = [U32(0x3C003C00), U32(0x3C003C00)]
        if dec.GROUPED:
            lo = scales_blk[..., self.lane_scale_off].to(torch.int64)
            hi = scales_blk[..., self.lane_scale_off + 1].to(torch.int64)
            sp2 = dec.scale_pair(U32(lo | (hi << 8)))
            sc2 = [self._ev(loop.scale_lo, dec, sp2=sp2, **_PTX_FUNCS), self._ev(loop.scale_hi, dec, sp2=sp2, **_PTX_FUNCS)]
        return w, sc2

    def lane_operands(self, fmt: str, codes_blk: torch.Tensor, scales_blk, loop: LoopRules, dec=None):
        """codes_blk: uint8 [T, KB, 32 * LANE_BYTES]; scales_blk uint8 [T, KB, 64] or None.
        Returns regs[(pair, j)] = (a0 lo, a0 hi, a1 lo, a1 hi), each float64 [T, KB, 32 lanes]:
        what each lane hands MMA j of activation load `pair`, and the number of pairs."""
        dec = dec or self._dec(fmt)
        w, sc2 = self._load(fmt, codes_blk, scales_blk, loop, dec)
        pairs = self._ev(loop.pairs, dec)
        regs = {}
        for p in range(pairs):
            s = self._ev(loop.scale_pick, dec, p=p, sc2=sc2)
            for j in range(2):
                a0 = dec.front_half2(w, self._ev(loop.a0, dec, j=j))
                a1 = dec.front_half2(w, self._ev(loop.a1, dec, j=j))
                if dec.GROUPED:
                    a0, a1 = PTX.hmul2(a0, s), PTX.hmul2(a1, s)
                regs[(p, j)] = h2(a0) + h2(a1)
            n = self._ev(loop.rotate, dec)
            w = [w[i + n] if i + n < len(w) else U32(0) for i in range(len(w))]   # rotate_words<S>
        return regs, pairs

    def b_operands(self, xk: torch.Tensor, rows: torch.Tensor, loop: LoopRules, dec,
                   p: int, j: int, kb: torch.Tensor, ks: int, ksplit: int):
        """B registers of every lane: from the lane's activation row (rows[lane]; a lane whose
        token is past M reads the row the kernel points it at), the 2 * X_REGS halves load_x
        reads at the parsed offset, picked by b_frag.
        Returns (b0 lo, b0 hi, b1 lo, b1 hi), each float64 [K, 32]."""
        at = self.r.atom
        base = torch.as_tensor(self._ev(loop.x_offset, dec, kb=kb, p=p, ks=ks, a=SimpleNamespace(ksplit=ksplit)))
        idx = base.reshape(-1, 1) + torch.arange(2 * at.X_REGS)                 # [K, 8]
        vals = xk[rows][:, idx]                                                 # [32, K, 8]
        xr = [(vals[..., 2 * r].t(), vals[..., 2 * r + 1].t()) for r in range(at.X_REGS)]
        picked = at.b_frag(xr, j, None, None)
        return picked["b0"] + picked["b1"]

    def _warp_sum(self, regs, pairs, xk, rows, loop, dec, kblocks, ks, ksplit, tiles=slice(None)):
        """D [T, 4, 8, 8] of the warp that runs k-blocks ks, ks + ksplit, ... of its tiles."""
        kbs = torch.arange(ks, kblocks, ksplit)
        d = None
        for p in range(pairs):
            for j in range(2):
                b = self.b_operands(xk, rows, loop, dec, p, j, kbs, ks, ksplit)
                a = tuple(r[tiles][:, kbs] for r in regs[(p, j)])
                dd = mma_m8n8k4(a, b)
                d = dd if d is None else d + dd
        return d

    def linear(self, packed, x: torch.Tensor, route, ksplit: int = 1, form: str = "restore") -> torch.Tensor:
        """y (float64, before the FP16 rounding) of the QPN route (a Route or its name) on these
        packed buffers; ``form`` "s7" runs the S7 entry points of an NVFP4 route (ops.nvfp4_form)."""
        from qpn.kernels import ops, routes
        at = self.r.atom
        fmt = packed.fmt
        m = x.shape[0]
        route = routes.as_route(route)
        if route.kernel == routes.RECONSTRUCT:
            return self.reconstruct(packed, x)
        from qpn.kernels import formats
        name, _, m_chunks = ops.route_kernel(route, m, form, formats.format_of(packed))
        entries = entry_points("qpn_kernels.cu", "QPN_LINEAR_ENTRY")
        atom_s, dec_s, mt = entries[f"{name}_m8n8k4"]
        allowed = {"nvfp4": ("DecNVFP4", "DecNVFP4S7"), "fp8": ("DecFP8",),
                   formats.INT4.family: ("DecINT4Sym",) if getattr(packed, "symmetric", False) else ("DecINT4",)}
        assert atom_s == "AtomM8N8K4" and dec_s in allowed[fmt], (name, dec_s)
        dec = self.r.decoders[dec_s]
        mt = int(mt)
        tile_n, kbk = at.TILE_N, at.K_BLOCK
        n_tiles, kblocks = -(-packed.n // tile_n), -(-packed.k // kbk)
        xk = torch.zeros((max(m, 1), kblocks * kbk), dtype=torch.float64)
        xk[:m, :packed.k] = x.double()
        lane_bytes = dec.WORDS * 4
        codes = packed.codes.view(n_tiles, kblocks, 32 * lane_bytes)
        if dec.GROUP_RECORDS:
            rec = self.int4_lane_records(packed, dec, n_tiles, kblocks, ksplit, mt)
            regs, pairs = self.int4_lane_operands(codes, rec, dec)
        else:
            scales = packed.scales.view(n_tiles, kblocks, at.SCALE_BLOCK_BYTES) if fmt == "nvfp4" else None
            regs, pairs = self.lane_operands(fmt, codes, scales, self.dense_loop, dec)
        y = torch.zeros((m, packed.n), dtype=torch.float64)
        writes = torch.zeros((m, packed.n), dtype=torch.int64)
        tpb = 8 // ksplit
        grid = -(-n_tiles // tpb) * m_chunks
        covered = torch.zeros((m_chunks, n_tiles), dtype=torch.int64)
        for chunk in range(m_chunks):
            m0 = self._ev(self.dense_m0, dec, chunk=chunk, MT=mt)
            # acc[t][ks]: the accumulator registers [tiles, 32 lanes, 8] of warp ks, token tile t
            acc = []
            for t in range(mt):
                toks = torch.tensor([self._ev(self.dense_tok, dec, m0=m0, t=t, lane=lane) for lane in _LANES])
                valid = toks < m
                rows = torch.where(valid, toks, 0)
                acc.append([lane_accumulators(self._warp_sum(regs, pairs, xk, rows, self.dense_loop, dec,
                                                             kblocks, ks, ksplit))
                            for ks in range(min(ksplit, kblocks))])
            # epilogue (transcribed): block = nblock * m_chunks + chunk, warp = tib * ksplit + ks,
            # tile = nblock * tpb + tib; red[warp][tok_l][row] = acc[i] at (acc_token, acc_row);
            # output (tib, tok_l, row): n = tile * TILE_N + row, tok = m0 + tok_l, sum over ks.
            for blk in range(grid):
                if blk % m_chunks != chunk:
                    continue
                nblock = blk // m_chunks
                for tib in range(tpb):
                    tile = self._ev(self.dense_tile, dec, nblock=nblock, tile_in_block=tib,
                                    a=SimpleNamespace(tiles_per_block=tpb))
                    if tile >= n_tiles:
                        continue
                    covered[chunk, tile] += 1
                    for t in range(mt):
                        tok = m0 + t * at.TOKENS + self.lane_acc_token
                        n = tile * tile_n + self.lane_acc_row
                        keep = (tok < m) & (n < packed.n)
                        v = sum(a[tile] for a in acc[t])
                        y.index_put_((tok[keep], n[keep]), v[keep], accumulate=True)
                        writes.index_put_((tok[keep], n[keep]), torch.ones_like(tok[keep]), accumulate=True)
        assert bool((covered == 1).all()), "the block grid must cover every (chunk, tile) once"
        assert bool((writes == 1).all()), "the epilogue must write every output element exactly once"
        # v *= <parsed factor>: ldgf(a.chscale + index) (NVFP4 passes [global], FP8 [1] or [N], ops.py),
        # times the decoder's OUT_MULT; evaluated for every output row n at once
        chscale = (packed.out_scale if dec.GROUP_RECORDS else packed.global_scale if fmt == "nvfp4"
                   else packed.scale).double().reshape(-1)
        args = SimpleNamespace(chscale=_Pointer(chscale), chscale_per_channel=int(chscale.numel() != 1))
        factor = torch.as_tensor(self._ev(self.dense_scale, dec, a=args, n=torch.arange(packed.n), ldgf=lambda v: v),
                                 dtype=torch.float64)
        return y * factor.expand(packed.n).reshape(1, -1)

    def reconstruct(self, packed, x: torch.Tensor) -> torch.Tensor:
        """qpn_reconstruct_body (transcribed): lane's words -> Dec::half2(w, idx) (* sc2[pick]) at
        workspace row tile * TILE_N + a_row(lane), columns kb * K_BLOCK + 2 idx, + 1; then the GEMM."""
        at = self.r.atom
        fmt = packed.fmt
        int4 = hasattr(packed, "symmetric")
        dec = (self.r.int4_sym if packed.symmetric else self.r.int4) if int4 else self._dec(fmt)
        n_tiles, kblocks = -(-packed.n // at.TILE_N), -(-packed.k // at.K_BLOCK)
        lane_bytes = dec.WORDS * 4
        codes = packed.codes.view(n_tiles, kblocks, 32 * lane_bytes)
        if int4:   # qpn_reconstruct_body's record of (tile, k-block, lane), parsed
            ru = self.int4_rules()
            args = SimpleNamespace(kblocks=kblocks)
            shift = self._group_shift(packed)
            gp = self._ev(ru.r_groups_pad, dec, kblocks=kblocks, group_shift=shift)
            off = self._ev(ru.r_rec, dec, tile=torch.arange(n_tiles).reshape(-1, 1, 1), groups_pad=gp,
                           kb=torch.arange(kblocks).reshape(1, -1, 1), group_shift=shift,
                           lane=torch.arange(32).reshape(1, 1, -1), a=args)
            rec = self._int4_records(packed, dec, off.expand(n_tiles, kblocks, 32))
            named = {"zb": getattr(dec, ru.r_zb)(rec), "sg": getattr(dec, ru.r_sg)(rec)}
            raw = codes.reshape(n_tiles, kblocks, 32, lane_bytes)
            w, sc2 = [U32(t) for t in _words(raw).unbind(-1)], None
        else:
            scales = packed.scales.view(n_tiles, kblocks, at.SCALE_BLOCK_BYTES) if fmt == "nvfp4" else None
            w, sc2 = self._load(fmt, codes, scales, self.dense_loop)
        ws = torch.full((n_tiles * at.TILE_N, kblocks * at.K_BLOCK), float("nan"), dtype=torch.float64)
        pick = self.recon_pick.group(1)
        rows = (torch.arange(n_tiles).reshape(-1, 1, 1) * at.TILE_N + self.lane_a_row.reshape(1, 1, 32))
        for idx in range(at.K_BLOCK // 2):
            hh = dec.half2(w, idx)
            if dec.GROUPED:
                hh = PTX.hmul2(hh, sc2[eval(c_expr(pick), {"idx": idx})])   # noqa: S307
            if dec.GROUP_RECORDS:
                hh = dec.apply(hh, *(named[v] for v in ru.r_apply))
            lo, hi = h2(hh)                                                   # [T, KB, 32]
            cols = (torch.arange(kblocks) * at.K_BLOCK + 2 * idx).reshape(1, -1, 1)
            r_, c_ = rows.expand(lo.shape), cols.expand(lo.shape)
            assert bool(torch.isnan(ws[r_, c_]).all()), "the reconstruct pass writes an element twice"
            ws[r_, c_] = lo
            ws[r_, c_ + 1] = hi
        assert not bool(torch.isnan(ws).any()), "the reconstruct pass left a workspace element unwritten"
        y = x.double() @ ws[: packed.n, : packed.k].t()
        if int4:
            return y * packed.out_scale.double().reshape(())
        if fmt == "nvfp4":
            return y * packed.global_scale.double().reshape(())
        return y * fp8_codec.channel_scales(packed.scale, packed.n).double().reshape(1, -1)

    # ---------------------------------------------------------------------------- MoE GEMMs
    def moe_gemm(self, stacks: list, x: torch.Tensor, x_row_div: int, sorted_pairs: list, groups: list,
                 gate_up: bool, ksplit: int = 1, num_pairs: int | None = None) -> list:
        """qpn_moe_gemm_body (transcribed control flow, parsed rules). groups: (expert, start, count).
        Returns, per stack (gate, up for gate_up; down alone otherwise), float64 [pairs, N] of the
        scaled products (before SwiGLU / FP16), NaN where the kernel writes nothing."""
        at = self.r.atom
        s0 = stacks[0]
        dec = self._dec(s0.fmt)
        loop = self.moe_loop
        lane_bytes = dec.WORDS * 4
        n_tiles, kblocks = -(-s0.n // at.TILE_N), -(-s0.k // at.K_BLOCK)
        xk = torch.zeros((x.shape[0], kblocks * at.K_BLOCK), dtype=torch.float64)
        xk[:, : min(x.shape[1], xk.shape[1])] = x.double()[:, : xk.shape[1]]
        pairs_total = num_pairs if num_pairs is not None else len(sorted_pairs)
        tpb = 8 // ksplit
        args = SimpleNamespace(tiles_per_block=tpb)
        half = self._ev(self.moe_half, dec, GATE_UP=gate_up, a=args)
        n_blocks = -(-n_tiles // (tpb // 2 if gate_up else tpb))       # kernels/moe.py's grid
        outs = [torch.full((pairs_total, s0.n), float("nan"), dtype=torch.float64) for _ in stacks]
        two = stacks if gate_up else [s0, s0]
        cache = {}
        for expert, start, count in groups:
            cols = torch.tensor([self._ev(self.moe_col, dec, lane=lane) for lane in _LANES])
            valid = cols < count
            rows = torch.tensor([sorted_pairs[start + int(c)] // x_row_div if bool(v) else 0
                                 for c, v in zip(cols, valid)])
            for nblock in range(n_blocks):
                for tib in range(tpb):
                    which = self._ev(self.moe_which, dec, GATE_UP=gate_up, tile_in_block=tib, half=half)
                    tile = self._ev(self.moe_tile, dec, nblock=nblock, half=half, tile_in_block=tib, which=which)
                    if tile >= n_tiles or tile < 0:
                        continue
                    st = two[which]
                    key = (which, expert)
                    if key not in cache:
                        codes = st.codes[expert].view(n_tiles, kblocks, 32 * lane_bytes)
                        scales = (st.scales[expert].view(n_tiles, kblocks, at.SCALE_BLOCK_BYTES)
                                  if dec.GROUPED else None)
                        cache[key] = self.lane_operands(s0.fmt, codes, scales, loop)
                    regs, pairs = cache[key]
                    acc = sum(lane_accumulators(self._warp_sum(regs, pairs, xk, rows, loop, dec, kblocks, ks,
                                                               ksplit, tiles=slice(tile, tile + 1)))
                              for ks in range(min(ksplit, kblocks)))[0]           # [32, 8]
                    # epilogue (transcribed): tok = acc_token, row = acc_row; n = tile * TILE_N + row
                    ch = st.chscale.double().reshape(-1)      # [E * chscale_stride], as the kernel reads it
                    args = SimpleNamespace(chscale_stride=st.chscale.shape[1], chscale_per_channel=int(st.per_channel))
                    out = outs[which]
                    for lane in range(32):
                        for i in range(at.ACC):
                            tok = int(self.lane_acc_token[lane, i])
                            n = tile * at.TILE_N + int(self.lane_acc_row[lane, i])
                            if tok >= count or n >= s0.n:
                                continue
                            pair = sorted_pairs[start + tok]
                            scale = float(ch[self._ev(self.moe_scale_index, dec, a=args, n=n, expert=expert)])
                            assert math.isnan(out[pair, n]), "the MoE epilogue writes an element twice"
                            out[pair, n] = float(acc[lane, i]) * scale
        return outs


def group_table(ids: torch.Tensor, experts: int, rows: int = 8) -> tuple[list, list]:
    """The align kernel's result up to the order inside an expert's run (which it leaves to the
    atomics): pairs grouped by expert, groups of at most `rows` pairs of one expert."""
    flat = ids.reshape(-1).tolist()
    order, groups = [], []
    for e in range(experts):
        mine = [p for p, v in enumerate(flat) if v == e]
        for j in range(0, len(mine), rows):
            groups.append((e, len(order) + j, min(rows, len(mine) - j)))
        order.extend(mine)
    return order, groups
