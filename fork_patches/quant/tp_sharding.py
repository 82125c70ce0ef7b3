"""Tensor-parallel sharding of the quantized modules: what each rank holds, and whether a split
keeps the QPN formats intact.

vLLM splits a checkpoint tensor by rank in its parameter loaders
(``vllm/model_executor/parameter.py``): a column-parallel module (q/k/v, gate/up, GDN in_proj,
the vocab-parallel ``lm_head``) narrows the output rows, each fused output partition on its own;
a row-parallel module (``o_proj``, ``down_proj``, GDN ``out_proj``) narrows the input columns.
Our NVFP4 parameters declare ``input_dim=1`` for both the codes (uint8 [N, K/2]) and the group
scales (e4m3 [N, K/16]), so a rank's codes and scales cover the same inputs only when K/TP is a
multiple of 16 (whole NVFP4 groups), and the prepacked buffer has no padding inside the rank's K
only when K/TP is a multiple of every atom's k-block. FP8 shards keep one scale per output
partition (``PerTensorScaleParameter``: one value per fused shard, on every rank). INT4 (AWQ, GPTQ,
compressed-tensors pack-quantized) is split the same way at its checkpoint's own group size (one
scale and zero point per 32, 64 or 128 inputs, so K/TP must hold whole groups), and a layout that
packs eight output rows per int32 word (AWQ's codes, every asymmetric zero-point tensor) needs a
multiple of 8 rows per rank in every fused output partition.

``plan`` gives the per-rank (N, K) of every module and the problems of a split; the launcher's
preflight (``serve_preflight.check_tp_split``) refuses a checkpoint that cannot be split at the
asked TP before any engine starts, naming the module.
"""
from __future__ import annotations

from dataclasses import dataclass

from qpn.kernels import formats  # torch-free: the format descriptions only
ROW_PARALLEL = ("o_proj", "down_proj", "out_proj")
VOCAB_PARALLEL = ("lm_head",)


def k_blocks() -> dict[str, int]:
    """k-block of every MMA atom the kernels are built for (kernels/atoms.py)."""
    from qpn.kernels.atoms import KNOWN_ATOMS, geometry

    return {atom: geometry(atom).k_block for atom in KNOWN_ATOMS}


@dataclass(frozen=True)
class Module:
    name: str
    region: str  # kernel family of qpn.kernels.formats ("nvfp4" | "fp8" | "int4")
    output_sizes: tuple[int, ...]  # rows of each fused output partition (one entry if unfused)
    k: int  # input features
    group: int | None = None  # inputs per group scale where the checkpoint chooses it (INT4); None: the format's
    rows_per_word: int = 1  # output rows packed into one stored word (INT4 layouts packing N: 8)

    @property
    def style(self) -> str:
        leaf = self.name.rsplit(".", 1)[-1]
        if leaf in VOCAB_PARALLEL:
            return "vocab"
        return "row" if leaf in ROW_PARALLEL else "column"


@dataclass(frozen=True)
class RankShape:
    name: str
    style: str
    n: int  # rows on each rank
    k: int  # input columns on each rank
    output_sizes: tuple[int, ...]


def per_rank(module: Module, tp: int) -> RankShape:
    if module.style == "row":
        return RankShape(module.name, "row", sum(module.output_sizes), module.k // tp,
                         module.output_sizes)
    sizes = tuple(s // tp for s in module.output_sizes)
    return RankShape(module.name, module.style, sum(sizes), module.k, sizes)


def problems(module: Module, tp: int, blocks: dict[str, int] | None = None) -> list[str]:
    """Why ``module`` cannot be split over ``tp`` ranks with the formats intact ([] if it can)."""
    blocks = k_blocks() if blocks is None else blocks
    out = []
    if module.style == "row":
        if module.k % tp:
            return [f"{module.name}: row-parallel input K={module.k} does not divide by TP={tp}"]
        k = module.k // tp
        fmt = formats.weight_format(module.region)
        group = module.group or fmt.group_size
        if group is not None and k % group:
            out.append(f"{module.name}: row-parallel K={module.k}/TP={tp} = {k} inputs per rank "
                       f"splits an {fmt.title} group (one {fmt.scale_name} scale per {group} inputs)")
        for atom, block in sorted(blocks.items()):
            if k % block:
                out.append(f"{module.name}: row-parallel K={module.k}/TP={tp} = {k} inputs per rank "
                           f"is not a whole number of {atom} k-blocks ({block} inputs)")
    else:
        for i, rows in enumerate(module.output_sizes):
            part = f" (fused output partition {i}: {rows} rows)" if len(module.output_sizes) > 1 else ""
            if rows % tp:
                out.append(f"{module.name}: {module.style}-parallel output N={rows}{part} does not "
                           f"divide by TP={tp}")
            elif (rows // tp) % module.rows_per_word:
                out.append(f"{module.name}: {module.style}-parallel output N={rows}{part}/TP={tp} = "
                           f"{rows // tp} rows per rank is not a whole number of stored words "
                           f"({module.rows_per_word} output rows each)")
    return out


def plan(modules: list[Module], tp: int) -> tuple[list[RankShape], list[str]]:
    """(per-rank shapes, problems) of splitting ``modules`` over ``tp`` ranks."""
    blocks = k_blocks()
    issues = [p for m in modules for p in problems(m, tp, blocks)]
    return [per_rank(m, tp) for m in modules], issues


# ------------------------------------------------------------------- from a checkpoint on disk
def _headers(ckpt: str) -> dict[str, list[int]]:
    """tensor name -> shape, from the safetensors headers (no tensor is read)."""
    from qpn.fork_patches.quant.conventions import tensor_headers

    return {name: h["shape"] for name, h in tensor_headers(ckpt).items()}


# vLLM's fused modules and the checkpoint shards they hold (Qwen3.5 / Qwen3-Next naming)
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def checkpoint_modules(ckpt: str, quantized_layers: dict, convention=None) -> list[Module]:
    """The quantized modules of a checkpoint as vLLM fuses them, from its declared modules and
    the safetensors headers (NVFP4 codes hold K/2 bytes per row, FP8 K; an integer convention's
    layout says which axis of its int32 codes is N or K). ``quantized_layers``: {module:
    ModuleScheme} with the ``convention`` that named its codes tensor
    (qpn.fork_patches.quant.conventions; the launcher's boot_gates.declared_modules), or ModelOpt's
    own {module: {quant_algo, ...}} map (codes in ``weight``)."""
    from qpn.fork_patches.quant.conventions import values_per_word

    shapes = _headers(ckpt)
    fused: dict[str, dict] = {}
    for name, entry in sorted(quantized_layers.items()):
        group, per_word, layout = None, 1, None
        if hasattr(entry, "format"):  # a conventions.ModuleScheme
            fmt = entry.format
            codes = convention.names(fmt).codes if convention is not None else "weight"
            if fmt.code_type == "int":  # the group size is the checkpoint's; the layout packs words
                layout, p = convention.layout, values_per_word(fmt)
                group, per_word = entry.group_size, p if convention.packs_outputs(entry) else 1
        else:
            algo = str(entry.get("quant_algo", "") if isinstance(entry, dict) else entry).upper()
            fmt, codes = formats.find_format(algo), "weight"
        shape = shapes.get(f"{name}.{codes}")
        if fmt is None or shape is None or len(shape) != 2:
            continue  # experts stacked elsewhere, or not a linear weight: vLLM reports those
        region = fmt.family
        n, k = layout.n_k(shape, p) if layout else (int(shape[0]), int(shape[1]) * fmt.codes_per_byte)
        base, _, leaf = name.rpartition(".")
        target, index = _FUSED.get(leaf, (leaf, 0))
        key = f"{base}.{target}" if base else target
        slot = fused.setdefault(key, {"region": region, "k": k, "parts": {}, "group": group, "per_word": per_word})
        slot["parts"][index] = n
    return [Module(name, s["region"], tuple(s["parts"][i] for i in sorted(s["parts"])), s["k"], s["group"],
                   s["per_word"])
            for name, s in sorted(fused.items())]
