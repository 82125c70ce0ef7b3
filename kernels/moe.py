"""QPN for mixture-of-experts: packed expert stacks and the grouped expert kernels.

A MoE layer's routed experts are three stacks of E same-shaped matrices: gate [E, I, H],
up [E, I, H] and down [E, H, I] (I = moe_intermediate_size per rank, H = hidden). Every expert
matrix is prepacked with the dense path's ``prepack_nvfp4`` / ``prepack_fp8`` and its inverse is
verified byte for byte before the stack keeps it; the stack is one contiguous buffer per tensor
(expert e at a fixed stride), so a kernel finds an expert's weights from its id alone.

``qpn_moe(x, topk_ids, topk_weights, packed, shared=None, shared_weight=None)`` computes
``y[t] = sum_k w[t,k] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` (e = topk_ids[t,k]) plus, when a
shared expert is given, ``shared_weight[t] * shared(x_t)``:

* on CUDA: csrc/qpn_moe.cu, four launches with grids fixed by (tokens * top_k, E): no host
  synchronisation, so the layer can be captured in a CUDA graph;
* on CPU: moe_reference.moe_reference over the same packed buffers.

Numerics (both paths): gate, up and down products accumulate in FP32; SwiGLU runs in FP32 on
the FP32 gate/up results and is rounded ONCE to FP16 (the down projection's activations, as
any activation that enters a QPN GEMM); the routed (and shared) down results are weighted and
summed in FP32 in slot order and rounded once to FP16.

Semantics of the routing: an expert id outside [0, E) (vLLM uses -1 for an expert that is not
on this rank) contributes nothing; the same expert twice for one token counts twice (each slot
is its own pair); an expert chosen by no token is never read.
"""
from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from . import families, formats, jit, prepack, routes
from .atoms import geometry
from .kernel_inputs import fp16_activations
from .moe_reference import MAX_EXPERTS, check_routing, moe_reference
from .prepack import split_gate_up

MOE_SOURCE = jit.MOE_SOURCES["m8n8k4"]
# Source per atom: the sm_80+ file includes qpn_moe.cu (routing, combine) and adds the m16n8k16
# expert GEMMs; it is built for sm_80 and later only. Both get their entry lines from data
# (jit.moe_entry_lines).
MOE_SOURCES = jit.MOE_SOURCES
MIN_ARCH = {"m8n8k4": 70, "m16n8k16": 80}
THREADS = 256
WARPS = THREADS // 32
ALIGN_THREADS = 1024
# Pairs per group = tokens of one MMA tile of the atom (the B side of m8n8k4 holds 8 tokens).
ROWS_PER_GROUP = {"m8n8k4": 8, "m16n8k16": 8}
MOE_ENTRY_POINTS = {
    "common": ("qpn_moe_align", "qpn_moe_combine"),
    **{atom: tuple(e for f in formats.FAMILIES.values() for e in f.moe_entry_points(atom))
       for atom in ("m8n8k4", "m16n8k16")},
}


MoeShapeError = formats.MoeShapeError  # defined with the formats so every layer can raise it


# ------------------------------------------------------------------------------ packed stacks
@dataclass
class PackedExpertStack(prepack.PackedLayout):
    """E expert matrices [N, K] of one projection, each prepacked like a dense weight."""

    fmt: str                       # kernel family of qpn.kernels.formats ("nvfp4" | "fp8")
    codes: torch.Tensor            # uint8 [E, code_bytes] (fragment order per expert)
    scales: Optional[torch.Tensor]  # uint8 [E, scale_bytes] e4m3 group scales (NVFP4), else None
    chscale: torch.Tensor          # float32 [E, 1] (NVFP4 global scale, FP8 per tensor) or [E, N] (FP8 per channel)
    n: int
    k: int
    atom: str = "m8n8k4"

    @property
    def num_experts(self) -> int:
        return int(self.codes.shape[0])

    @property
    def per_channel(self) -> bool:
        return self.chscale.shape[1] != 1

    @property
    def n_tiles(self) -> int:
        return self.n_pad // geometry(self.atom).tile_n

    @property
    def nbytes_per_expert(self) -> int:
        s = self.scales.shape[1] if self.scales is not None else 0
        return self.codes.shape[1] + s + self.chscale.shape[1] * 4

    def expert(self, e: int):
        """Expert e as a dense PackedNVFP4 / PackedFP8 (views of the stack, no copy)."""
        return families.numerics(self.format).packed_from_tensors(
            self.codes[e], None if self.scales is None else self.scales[e], self.chscale[e], self.n, self.k,
            self.atom)

    def with_channel_scales(self) -> "PackedExpertStack":
        """The same stack with a per-channel [E, N] chscale (codes shared, not copied)."""
        if self.per_channel:
            return self
        return PackedExpertStack(self.fmt, self.codes, self.scales,
                                 self.chscale.expand(-1, self.n).contiguous(), self.n, self.k, self.atom)

    def tensors(self) -> list[torch.Tensor]:
        scales = self.scales if self.scales is not None else self.codes.new_empty((0,))
        return [self.codes, scales, self.chscale]


@dataclass
class PackedMoE:
    """gate, up [E, I, H] and down [E, H, I] stacks of one MoE layer (or of a shared expert, E=1)."""

    gate: PackedExpertStack
    up: PackedExpertStack
    down: PackedExpertStack

    def __post_init__(self):
        g, u, d = self.gate, self.up, self.down
        if not (g.num_experts == u.num_experts == d.num_experts):
            raise MoeShapeError(f"gate/up/down stacks hold {g.num_experts}/{u.num_experts}/{d.num_experts} "
                                "experts; all three must hold the same experts")
        if (g.n, g.k) != (u.n, u.k) or g.fmt != u.fmt or g.atom != u.atom:
            raise MoeShapeError(f"gate ({g.fmt} {g.n}x{g.k}) and up ({u.fmt} {u.n}x{u.k}) projections must "
                                "have one shape and one format (they run in one fused kernel)")
        if (d.n, d.k) != (g.k, g.n):
            raise MoeShapeError(f"down projection is {d.n}x{d.k}; for gate/up {g.n}x{g.k} it must be {g.k}x{g.n}")
        if g.per_channel != u.per_channel:  # one chscale layout for the fused gate/up kernel
            self.gate, self.up = g.with_channel_scales(), u.with_channel_scales()

    @property
    def num_experts(self) -> int:
        return self.gate.num_experts

    @property
    def hidden(self) -> int:
        return self.gate.k

    @property
    def intermediate(self) -> int:
        return self.gate.n

    @property
    def atom(self) -> str:
        return self.gate.atom

    @property
    def device(self) -> torch.device:
        return self.gate.device

    def to(self, device) -> "PackedMoE":
        return PackedMoE(self.gate.to(device), self.up.to(device), self.down.to(device))

    def tensors(self) -> list[torch.Tensor]:
        return self.gate.tensors() + self.up.tensors() + self.down.tensors()

    @property
    def fmts(self) -> str:
        return f"{self.gate.fmt},{self.down.fmt}"

    @classmethod
    def from_tensors(cls, ts: list[torch.Tensor], fmts: str, hidden: int, inter: int, atom: str) -> "PackedMoE":
        gu_fmt, d_fmt = fmts.split(",")

        def stack(i, fmt, n, k):
            codes, scales, ch = ts[3 * i: 3 * i + 3]
            has_scales = formats.weight_format(fmt).has_group_scales
            return PackedExpertStack(fmt, codes, scales if has_scales else None, ch, n, k, atom)

        return cls(stack(0, gu_fmt, inter, hidden), stack(1, gu_fmt, inter, hidden), stack(2, d_fmt, hidden, inter))


def prepack_expert_stack(fmt: str, weight: torch.Tensor, weight_scale: torch.Tensor,
                         weight_scale_2=None, atom: str = "m8n8k4") -> PackedExpertStack:
    """Checkpoint tensors of E experts -> PackedExpertStack, each expert's inverse verified.

    NVFP4: weight uint8 [E, N, K/2], weight_scale e4m3 [E, N, K/16], weight_scale_2 float32 [E]
    (global scale per expert). FP8: weight e4m3 [E, N, K], weight_scale float32 [E] (per tensor)
    or [E, N] (per channel). Raises prepack.PrepackMismatch naming the expert when an inverse is
    not byte-identical, MoeShapeError / formats.FormatError naming the expert on a bad shape."""
    if weight.dim() != 3:
        raise MoeShapeError(f"expert weights must be 3-D [E, N, ...], got shape {tuple(weight.shape)}")
    e_count = weight.shape[0]
    if e_count < 1:
        raise MoeShapeError("an expert stack needs at least one expert")
    wf = formats.find_format(fmt)
    if wf is None or wf.family not in formats.MOE_FAMILIES:
        raise MoeShapeError(f"expert weight format {fmt!r} has no QPN MoE kernels; expected one of "
                            f"{sorted(formats.MOE_FAMILIES)}")
    num = families.numerics(wf)
    codes = scales = None
    chs = []
    n = k = 0
    for e in range(e_count):
        try:
            src = num.expert_source(e, weight, weight_scale, weight_scale_2)
            p = num.prepack(*src, atom=atom)
            num.verify_roundtrip(p, *src)
            ch = families.kernel_tensors(p)[2]
        except prepack.PrepackMismatch as err:
            raise prepack.PrepackMismatch(f"expert {e}: {err}") from err
        except formats.FormatError as err:
            raise formats.FormatError(f"expert {e}: {err}") from err
        if codes is None:
            n, k = p.n, p.k
            codes = torch.empty((e_count, p.codes.numel()), dtype=torch.uint8, device=weight.device)
            if wf.has_group_scales:
                scales = torch.empty((e_count, p.scales.numel()), dtype=torch.uint8, device=weight.device)
        codes[e] = p.codes
        if scales is not None:
            scales[e] = p.scales
        chs.append(ch.to(weight.device))
    width = max(c.numel() for c in chs)
    chscale = torch.stack([c.expand(width) if c.numel() == 1 else c for c in chs]).to(torch.float32).contiguous()
    return PackedExpertStack(wf.family, codes, scales, chscale, n, k, atom)


def prepack_moe(fmt: str, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2=None,
                down_fmt: Optional[str] = None, atom: str = "m8n8k4") -> PackedMoE:
    """A layer's expert tensors in vLLM's fused layout -> PackedMoE.

    w13 [E, 2I, ...] (gate rows first), w2 [E, H, ...]. NVFP4 scales: w13_scale [E, 2I, H/16],
    w13_scale_2 [E, 2] (gate, up) or [E] (one for both), w2_scale [E, H, I/16], w2_scale_2 [E].
    FP8: w13_scale [E, 2] / [E] / [E, 2I]; w2_scale [E] / [E, H]; *_scale_2 unused."""
    inter = w13.shape[1] // 2
    wf = formats.weight_format(fmt)
    gate_src, up_src = families.numerics(wf).moe_gate_up_sources(*split_gate_up(w13, inter), w13_scale,
                                                                 w13_scale_2, inter)
    gate = prepack_expert_stack(wf.family, *gate_src, atom=atom)
    up = prepack_expert_stack(wf.family, *up_src, atom=atom)
    dwf = formats.weight_format(down_fmt or fmt)
    down = prepack_expert_stack(dwf.family, *families.numerics(dwf).moe_down_source(w2, w2_scale, w2_scale_2),
                                atom=atom)
    return PackedMoE(gate, up, down)


# ------------------------------------------------------------------------------------ build
_modules: dict = {}
_lock = threading.Lock()


def entry_points(atom: str = "m8n8k4") -> tuple[str, ...]:
    if atom not in MOE_ENTRY_POINTS:
        raise ValueError(f"no MoE kernels for atom {atom!r}; known: {[a for a in MOE_ENTRY_POINTS if a != 'common']}")
    return MOE_ENTRY_POINTS["common"] + MOE_ENTRY_POINTS[atom]


def compile_cubin(arch, use_cache: bool = True, atom: str = "m8n8k4") -> tuple[bytes, str]:
    """Compile the MoE source of ``atom`` for sm_<arch> through jit.compile_cubin (the same
    cache and key rules as the dense kernels)."""
    a = jit.arch_number(arch)
    if atom not in MOE_SOURCES:
        raise ValueError(f"no MoE kernels for atom {atom!r}; known: {sorted(MOE_SOURCES)}")
    if a < MIN_ARCH[atom]:
        raise ValueError(f"the {atom} MoE kernels need sm_{MIN_ARCH[atom]} or later, asked for sm_{a}; "
                         "prepack the experts with atom='m8n8k4' for this GPU")
    return jit.compile_cubin(a, use_cache=use_cache, source=MOE_SOURCES[atom])


def check_entry_points(cubin: bytes, atom: str = "m8n8k4") -> None:
    for name in entry_points(atom):
        if name.encode() + b"\0" not in cubin:
            raise jit.QpnBuildError(f"built QPN MoE module lacks the entry point {name!r} (atom {atom}); "
                                    "csrc/qpn_moe.cu and kernels/moe.py:MOE_ENTRY_POINTS disagree")


def build(arch="sm70", atom: str = "m8n8k4") -> str:
    """Compile the MoE kernels of ``atom`` for ``arch`` (cached), check every entry point;
    returns the cubin path."""
    cubin, path = compile_cubin(arch, atom=atom)
    check_entry_points(cubin, atom)
    return path


def module_for(device, atom: str = "m8n8k4") -> jit.LoadedModule:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    m = _modules.get((idx, atom))
    if m is not None:
        return m
    with _lock:
        m = _modules.get((idx, atom))
        if m is None:
            major, minor = torch.cuda.get_device_capability(idx)
            arch = major * 10 + minor
            cubin, path = compile_cubin(arch, atom=atom)
            check_entry_points(cubin, atom)
            with torch.cuda.device(idx):
                torch.cuda.current_stream(idx).synchronize()  # torch's primary context current
                m = jit.LoadedModule(cubin, path, arch)
                for name in entry_points(atom):
                    m.function(name)
            _modules[(idx, atom)] = m
    return m


# ----------------------------------------------------------------------------------- launch
class MoeAlignArgs(ctypes.Structure):
    # struct MoeAlignArgs in csrc/qpn_moe.cu; names, offsets and size checked by tests/test_ctypes_structs.py.
    _fields_ = [("topk_ids", ctypes.c_void_p), ("sorted_pairs", ctypes.c_void_p),
                ("group_expert", ctypes.c_void_p), ("group_start", ctypes.c_void_p),
                ("group_count", ctypes.c_void_p), ("num_groups", ctypes.c_void_p),
                ("pairs", ctypes.c_int), ("num_experts", ctypes.c_int), ("rows_per_group", ctypes.c_int)]


class MoeGemmArgs(ctypes.Structure):
    # struct MoeGemmArgs in csrc/qpn_moe.cu; names, offsets and size checked by tests/test_ctypes_structs.py.
    _fields_ = [("codes", ctypes.c_void_p * 2), ("scales", ctypes.c_void_p * 2), ("chscale", ctypes.c_void_p * 2),
                ("code_stride", ctypes.c_longlong), ("scale_stride", ctypes.c_longlong),
                ("chscale_stride", ctypes.c_int), ("chscale_per_channel", ctypes.c_int),
                ("x", ctypes.c_void_p), ("ldx", ctypes.c_int), ("x_row_div", ctypes.c_int),
                ("sorted_pairs", ctypes.c_void_p), ("group_expert", ctypes.c_void_p),
                ("group_start", ctypes.c_void_p), ("group_count", ctypes.c_void_p),
                ("num_groups", ctypes.c_void_p), ("y", ctypes.c_void_p), ("ldy", ctypes.c_int),
                ("n", ctypes.c_int), ("kblocks", ctypes.c_int), ("ksplit", ctypes.c_int),
                ("tiles_per_block", ctypes.c_int), ("n_blocks", ctypes.c_int)]


class MoeCombineArgs(ctypes.Structure):
    # struct MoeCombineArgs in csrc/qpn_moe.cu; names, offsets and size checked by tests/test_ctypes_structs.py.
    _fields_ = [("d", ctypes.c_void_p), ("ids", ctypes.c_void_p), ("w", ctypes.c_void_p),
                ("d2", ctypes.c_void_p), ("w2", ctypes.c_void_p), ("y", ctypes.c_void_p),
                ("tokens", ctypes.c_int), ("top_k", ctypes.c_int), ("num_experts", ctypes.c_int),
                ("h", ctypes.c_int)]


def max_groups(pairs: int, num_experts: int, rows: int) -> int:
    """Upper bound of the groups the align kernel can form: every group holds >= 1 pair, and
    sum_e ceil(c_e / R) <= ceil(P / R) + (experts with c_e > 0)."""
    return max(1, min(pairs, -(-pairs // rows) + min(num_experts, pairs)))


def _sms(device) -> int:
    return jit.sm_count(device.index if device.index is not None else torch.cuda.current_device())


def split_for(n_tiles_total: int, kblocks: int, est_groups: int, sms: int, max_ksplit: int) -> int:
    """K-split per warp tile: grow until the expected grid offers ~32 warps per SM. Decided from
    host-known sizes only (the real group count lives on the device)."""
    want = 32 * sms
    ksplit = 1
    while ksplit < max_ksplit and est_groups * n_tiles_total * ksplit < want and ksplit * 2 <= max(1, kblocks):
        ksplit *= 2
    return ksplit


def _gemm(mod, name, stacks: list[PackedExpertStack], x: torch.Tensor, ldx: int, x_row_div: int, groups,
          g_max: int, y: torch.Tensor, ldy: int, gate_up: bool, est_groups: int, stream: int) -> None:
    s0 = stacks[0]
    g = geometry(s0.atom)
    kblocks = s0.k_pad // g.k_block
    n_tiles = s0.n_tiles
    max_ks = WARPS // 2 if gate_up else WARPS
    ksplit = split_for(n_tiles * (2 if gate_up else 1), kblocks, est_groups, _sms(x.device), max_ks)
    tpb = WARPS // ksplit
    half = tpb // 2 if gate_up else tpb
    n_blocks = -(-n_tiles // half)
    two = stacks if gate_up else [s0, s0]
    sorted_pairs, gexp, gstart, gcount, ngroups = groups
    a = MoeGemmArgs()
    a.codes = (ctypes.c_void_p * 2)(*[s.codes.data_ptr() for s in two])
    a.scales = (ctypes.c_void_p * 2)(*[(s.scales.data_ptr() if s.scales is not None else 0) for s in two])
    a.chscale = (ctypes.c_void_p * 2)(*[s.chscale.data_ptr() for s in two])
    a.code_stride = s0.codes.shape[1]
    a.scale_stride = s0.scales.shape[1] if s0.scales is not None else 0
    a.chscale_stride = s0.chscale.shape[1]
    a.chscale_per_channel = int(s0.per_channel)
    a.x, a.ldx, a.x_row_div = x.data_ptr(), ldx, x_row_div
    a.sorted_pairs, a.group_expert = sorted_pairs.data_ptr(), gexp.data_ptr()
    a.group_start, a.group_count, a.num_groups = gstart.data_ptr(), gcount.data_ptr(), ngroups.data_ptr()
    a.y, a.ldy = y.data_ptr(), ldy
    a.n, a.kblocks, a.ksplit, a.tiles_per_block, a.n_blocks = s0.n, kblocks, ksplit, tpb, n_blocks
    smem = WARPS * g.tile_n * ROWS_PER_GROUP[s0.atom] * 4
    jit.launch(mod, name, g_max * n_blocks, THREADS, smem, stream, [a])


def _routed_down(mod, xh: torch.Tensor, ids32: torch.Tensor, top_k: int, packed: PackedMoE,
                 stream: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp16 SwiGLU activations [P, ldh], FP32 down-projection result [P, H]) per pair; rows of
    pairs with an invalid id are left unwritten (the combine skips them)."""
    dev = xh.device
    pairs = ids32.numel()
    e_count = packed.num_experts
    atom = packed.atom
    rows = ROWS_PER_GROUP[atom]
    g_max = max_groups(pairs, e_count, rows)
    sorted_pairs = torch.empty(pairs, dtype=torch.int32, device=dev)
    meta = torch.empty(3 * g_max + 1, dtype=torch.int32, device=dev)
    gexp, gstart, gcount, ngroups = meta[:g_max], meta[g_max:2 * g_max], meta[2 * g_max:3 * g_max], meta[3 * g_max:]
    al = MoeAlignArgs(ids32.data_ptr(), sorted_pairs.data_ptr(), gexp.data_ptr(), gstart.data_ptr(),
                      gcount.data_ptr(), ngroups.data_ptr(), pairs, e_count, rows)
    jit.launch(mod, "qpn_moe_align", 1, ALIGN_THREADS, 16 * e_count, stream, [al])
    groups = (sorted_pairs, gexp, gstart, gcount, ngroups)
    est = min(pairs, e_count)
    ldh = packed.down.k_pad
    tile_n = geometry(atom).tile_n
    alloc = torch.zeros if ldh > packed.gate.n_tiles * tile_n else torch.empty
    h = alloc((pairs, ldh), dtype=torch.float16, device=dev)
    _gemm(mod, packed.gate.format.moe_entry_points(atom)[0], [packed.gate, packed.up], xh, xh.shape[1], top_k, groups,
          g_max, h, ldh, True, est, stream)
    d = torch.empty((pairs, packed.hidden), dtype=torch.float32, device=dev)
    _gemm(mod, packed.down.format.moe_entry_points(atom)[1], [packed.down], h, ldh, 1, groups, g_max, d, packed.hidden,
          False, est, stream)
    return h, d


def _moe_cuda(x, topk_ids, topk_weights, packed: PackedMoE, shared: Optional[PackedMoE],
              shared_weight: Optional[torch.Tensor], stages: Optional[dict] = None) -> torch.Tensor:
    tokens, top_k = topk_ids.shape
    y = torch.empty((tokens, packed.hidden), dtype=torch.float16, device=x.device)
    if tokens == 0:
        return y
    mod = module_for(x.device, packed.atom)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    ids32 = topk_ids.reshape(-1).to(torch.int32).contiguous()
    w32 = topk_weights.reshape(-1).to(torch.float32).contiguous()
    xh = fp16_activations(x, packed.hidden, packed.gate.k_pad)
    h, d = _routed_down(mod, xh, ids32, top_k, packed, stream)
    if stages is not None:
        stages.update(h=h[:, :packed.intermediate], d=d)
    d2 = w2 = None
    if shared is not None:
        zeros = torch.zeros(tokens, dtype=torch.int32, device=x.device)
        _, d2 = _routed_down(mod, xh, zeros, 1, shared, stream)
        if shared_weight is not None:
            w2 = shared_weight.reshape(-1).to(torch.float32).contiguous()
    c = MoeCombineArgs(d.data_ptr(), ids32.data_ptr(), w32.data_ptr(), d2.data_ptr() if d2 is not None else 0,
                       w2.data_ptr() if w2 is not None else 0, y.data_ptr(), tokens, top_k, packed.num_experts,
                       packed.hidden)
    jit.launch(mod, "qpn_moe_combine", -(-tokens * packed.hidden // THREADS), THREADS, 0, stream, [c])
    return y


# ----------------------------------------------------------------------------- custom op
@torch.library.custom_op("qpn::moe_experts", mutates_args=())
def moe_experts_op(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   routed: list[torch.Tensor], shared: list[torch.Tensor], shared_weight: Optional[torch.Tensor],
                   fmts: str, shared_fmts: str, hidden: int, inter: int, shared_inter: int,
                   atom: str) -> torch.Tensor:
    packed = PackedMoE.from_tensors(routed, fmts, hidden, inter, atom)
    sh = PackedMoE.from_tensors(shared, shared_fmts, hidden, shared_inter, atom) if shared else None
    if x.device.type != "cuda":
        return moe_reference(x, topk_ids, topk_weights, packed, sh, shared_weight)
    return _moe_cuda(x, topk_ids, topk_weights, packed, sh, shared_weight)


@moe_experts_op.register_fake
def _(x, topk_ids, topk_weights, routed, shared, shared_weight, fmts, shared_fmts, hidden, inter, shared_inter, atom):
    return x.new_empty((topk_ids.shape[0], hidden), dtype=torch.float16)


def qpn_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, packed: PackedMoE,
            shared: Optional[PackedMoE] = None, shared_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Routed experts (+ optional shared expert) of one MoE layer; x [T, H] -> fp16 [T, H].

    topk_ids [T, top_k] integer (ids outside [0, E) contribute nothing), topk_weights [T, top_k]
    float; shared: a PackedMoE with one expert, applied to every token with weight
    shared_weight [T] (1 when None)."""
    check_routing(x, topk_ids, topk_weights, packed)
    if shared is not None:
        if shared.num_experts != 1 or shared.hidden != packed.hidden or shared.atom != packed.atom:
            raise MoeShapeError(f"shared expert must be one expert of hidden {packed.hidden} (got "
                                f"{shared.num_experts} experts of hidden {shared.hidden})")
        if shared_weight is not None and shared_weight.numel() != x.shape[0]:
            raise MoeShapeError(f"shared_weight must hold one value per token ({x.shape[0]}), got {shared_weight.numel()}")
    return torch.ops.qpn.moe_experts(
        x, topk_ids, topk_weights, packed.tensors(), shared.tensors() if shared is not None else [],
        shared_weight, packed.fmts, shared.fmts if shared is not None else "", packed.hidden,
        packed.intermediate, shared.intermediate if shared is not None else 0, packed.atom)


def moe_stages_cuda(x, topk_ids, topk_weights, packed: PackedMoE, shared: Optional[PackedMoE] = None,
                    shared_weight: Optional[torch.Tensor] = None) -> dict:
    """The kernels' intermediate results, for numerics tests: {"h": fp16 SwiGLU activations
    [P, I] per pair, "d": FP32 down results [P, H] per pair, "y": the layer output}."""
    check_routing(x, topk_ids, topk_weights, packed)
    stages: dict = {}
    stages["y"] = _moe_cuda(x, topk_ids, topk_weights, packed, shared, shared_weight, stages)
    return stages


def moe_route(packed: PackedMoE) -> str:
    """Census route name of a MoE layer's grouped kernels (routes.moe_route_for)."""
    return routes.moe_route_for(packed.gate.fmt)
