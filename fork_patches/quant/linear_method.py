"""Per-module linear methods of the QPN path: NVFP4 regions -> QPN2 family, FP8 -> QPN8 family.

Life of one quantized module (vLLM's LinearMethodBase contract):

1. ``create_weights``: register the checkpoint's tensors exactly as stored (NVFP4: uint8 codes
   [N, K/2], e4m3 ``weight_scale`` [N, K/16], float32 ``weight_scale_2`` and ``input_scale`` per
   shard; FP8: e4m3 ``weight`` [N, K], float32 ``weight_scale`` and ``input_scale`` per shard).
   Every tensor is checked as it is loaded (dtype, shape, finite and non-negative scales) and
   every shard that received it is recorded, so a broken checkpoint fails the load with an
   error that names the module, the shard and the problem.
2. ``process_weights_after_loading``: every shard must have its weight and scales; then prepack
   (qpn.kernels.prepack), prove the inverse gives the source bytes back byte for byte, and only
   then free the source tensors. No FP16 copy of a weight is made at any point.
   Fused shards keep their own scales, unchanged: FP8 shards with different per-tensor scales
   get a per-output-channel scale vector (each shard's scalar repeated over its rows; the codes
   are untouched, nothing is requantized); NVFP4 shards with different global scales are packed
   as separate pieces (one call each, outputs concatenated).
3. ``apply``: one custom op (``qpn_loader::linear``, opaque to torch.compile) whose body takes
   M = rows in the batch, route = qpn.kernels.routes.route_for(fmt, M, N, K), runs
   qpn.kernels.ops.qpn_linear(x, packed, route) and counts the call in the route census (calls
   made while capturing a CUDA graph counted separately; a graph replay runs no Python, so
   replays are not counted).

The same method serves ``lm_head`` (vLLM's LogitsProcessor calls ``lm_head.quant_method.apply``),
so the head runs from the checkpoint's own NVFP4 codes.

Tensor names and the global-scale rule come from the checkpoint's convention
(qpn.fork_patches.quant.conventions; ModelOpt by default): compressed-tensors names the NVFP4 tensors
``weight_packed`` / ``weight_scale`` / ``weight_global_scale`` (a divisor: QPN multiplies by its
float32 reciprocal, per shard) / ``input_global_scale``, and may store FP8 scales per output
channel ([N, 1], ``fp8_scale="channel"``).

INT4 W4A16 (QPN4LinearMethod; ``int4_method_for`` builds it for the registered QPN config, which
hands it out unless QPN_INT4=0: qpn_config.int4_served) registers the tensors of its
checkpoint convention (qpn.fork_patches.quant.conventions.AWQ / GPTQ / CT_PACK_QUANTIZED) as stored,
with vLLM's packed / group-scale parameter classes placed by the convention's layout. Before the
prepack, the canonical source the family unpacker made is written back in the convention's layout
and must equal the loaded words (so a misread nibble order or zero point refuses the module);
then the packed inverse is proven as for the other families. A row-parallel split that breaks a
group, and an act-ordered g_idx, are refused naming the module.

The activation scales (``input_scale``) are loaded, checked, and dropped: QPN computes with FP16
activations (W4A16 / W8A16), so they have no use.
"""
from __future__ import annotations

import logging

import torch
from vllm.model_executor.layers.linear import (
    LinearMethodBase,
    QKVParallelLinear,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.parameter import (
    BasevLLMParameter,
    ChannelQuantScaleParameter,
    GroupQuantScaleParameter,
    ModelWeightParameter,
    PackedvLLMParameter,
    PerTensorScaleParameter,
    RowvLLMParameter,
)

from qpn.fork_patches.route_census.census import CENSUS
from qpn.fork_patches.quant.conventions import (
    INT4_CONVENTIONS,
    INT4_STORED_DTYPES,
    MODELOPT,
    Convention,
    ConventionError,
    INT4Convention,
    INT4Scheme,
)
from qpn.kernels import families, formats, prepack
from qpn.kernels.families.int4 import checkpoint as int4_checkpoint
from qpn.kernels.families.int4 import codec as int4_codec

logger = logging.getLogger("vllm.qpn.linear_method")

GROUP_SIZE = formats.NVFP4.group_size


class QPNCheckpointError(ValueError):
    """A checkpoint tensor or declaration the QPN path cannot serve; names module and problem."""


def _capturing_cuda_graph() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class _QPNLinearMethod(LinearMethodBase):
    weight_format: formats.WeightFormat  # the family's format (qpn.kernels.formats)
    fmt: str = ""                        # its kernel family name: census region, packed layout

    def __init__(self, prefix: str, algo: str, backend: str, arch: str = "sm70",
                 atom: str = "m8n8k4", shard_names: list[str] | None = None,
                 declared: list[str] | None = None, convention: Convention | None = None,
                 fp8_scale: str = "tensor") -> None:
        self.prefix = prefix
        # The checkpoint convention names the tensors (= our parameter names) and says how a
        # stored global scale becomes the multiplier QPN uses (qpn.fork_patches.quant.conventions).
        self.convention = convention or MODELOPT
        self.fp8_scale = fp8_scale  # FP8 only: "tensor" (one per shard) or "channel" ([N, 1])
        self.declared = declared  # the checkpoint's quantized_layers names this module serves
        self.algo = algo
        self.backend = backend
        self.arch = arch
        self.atom = atom  # the fragment order the weights are prepacked in
        self.shard_names = list(shard_names or [])
        self.partition_sizes: list[int] = []
        self.n = self.k = 0
        self.loaded: dict[str, set[int]] = {}
        self.pieces: list[tuple[int, int, object]] = []  # (row0, row1, packed)
        self.census_name: str | None = None
        self.op_id: int | None = None
        self._ops = None

    # ------------------------------------------------------------------------- descriptions
    @property
    def format(self) -> formats.WeightFormat:
        """This module's numeric format (FP8 per tensor or per channel by ``fp8_scale``)."""
        return formats.weight_format(self.weight_format, output_scale=self.fp8_scale)

    def _where(self) -> str:
        return f"{self.prefix} ({self.algo}, {self.format.method_family} route family)"

    def _shard_label(self, idx: int) -> str:
        r0 = sum(self.partition_sizes[:idx])
        r1 = r0 + self.partition_sizes[idx]
        label = f"output shard {idx} of {len(self.partition_sizes)} (rows {r0}-{r1 - 1})"
        if len(self.shard_names) == len(self.partition_sizes):
            base = self.prefix.rsplit(".", 1)[0]
            label += f", shard module {base}.{self.shard_names[idx]}"
        return label

    def _parts(self, shard) -> list[int]:
        if shard is None:
            return list(range(len(self.partition_sizes)))
        if isinstance(shard, str):
            return [{"q": 0, "k": 1, "v": 2}[shard]]
        if isinstance(shard, tuple):
            return [int(i) for i in shard]
        return [int(shard)]

    def _expected_rows(self, layer, shard) -> int:
        """Rows of the checkpoint tensor for this shard, before tensor-parallel splitting."""
        if isinstance(layer, VocabParallelEmbedding):
            return int(layer.org_vocab_size)
        if shard is None:
            return int(layer.output_size)
        if isinstance(layer, QKVParallelLinear) and isinstance(shard, str):
            heads = {"q": layer.total_num_heads, "k": layer.total_num_kv_heads,
                     "v": layer.total_num_kv_heads}[shard]
            dim = layer.v_head_size if shard == "v" else layer.head_size
            return int(heads * dim)
        sizes = getattr(layer, "output_sizes", None)
        idx = [shard] if isinstance(shard, int) else list(shard)
        return int(sum(sizes[i] for i in idx))

    # --------------------------------------------------------------------------- checking
    def _fail(self, msg: str):
        raise QPNCheckpointError(f"{self._where()}: {msg}")

    def _prepack_proven(self, src: tuple, rows: str = ""):
        """The packed weight of ``src`` once its unpacked form is proven byte-identical to ``src``
        (the sources may be freed only after this returns); a failure names the module and rows."""
        what = f" for rows {rows}" if rows else ""
        try:
            num = families.numerics(self.format)
            packed = num.prepack(*src, atom=self.atom)
            num.verify_roundtrip(packed, *src)
        except prepack.PrepackMismatch as e:
            self._fail(f"prepack inverse is not byte-identical{what}: {e}")
        except formats.FormatError as e:
            self._fail(f"cannot prepack{what}: {e}")
        return packed

    def _expected_cols(self, name: str, k_full: int) -> int | None:
        raise NotImplementedError

    def _expected_dtype(self, name: str) -> tuple[torch.dtype, ...]:
        raise NotImplementedError

    def _check_tensor(self, layer, name: str, t: torch.Tensor, shard) -> None:
        parts = self._parts(shard)
        what = f"tensor {name} of " + ", ".join(self._shard_label(i) for i in parts)
        if t.dtype not in self._expected_dtype(name):
            self._fail(f"{what} is stored as {t.dtype}, expected "
                       f"{' or '.join(str(d) for d in self._expected_dtype(name))}; the checkpoint does "
                       f"not hold {self.algo} data for this module (check quantized_layers)")
        k_full = int(layer.input_size)
        cols = self._expected_cols(name, k_full)
        if cols is None:  # a per-tensor scalar
            if t.numel() != 1:
                self._fail(f"{what} has shape {tuple(t.shape)}; a per-tensor scale must hold one value")
        else:
            rows = self._expected_rows(layer, shard)
            if tuple(t.shape) != (rows, cols):
                self._fail(f"{what} has shape {tuple(t.shape)}, expected ({rows}, {cols}) for "
                           f"K={k_full} input features" +
                           (f" (one e4m3 scale per {GROUP_SIZE} inputs)" if name == "weight_scale" else ""))
        if name in self._scale_names():
            v = t.float()
            n_nan = int(torch.isnan(v).sum())
            n_inf = int(torch.isinf(v).sum())
            if n_nan or n_inf:
                self._fail(f"{what} is not finite: {n_nan} NaN and {n_inf} inf value(s) out of "
                           f"{v.numel()}; re-export the checkpoint")
            if bool((v < 0).any()):
                self._fail(f"{what} holds negative scale(s); scales must be >= 0")

    def _checked_loader(self, layer, name: str, loader):
        def load(param, loaded_weight, *args, **kwargs):
            shard = args[0] if args else kwargs.get("loaded_shard_id")
            self._check_tensor(layer, name, loaded_weight, shard)
            try:
                out = loader(param, loaded_weight, *args, **kwargs)
            except (AssertionError, RuntimeError, ValueError, IndexError) as e:
                raise QPNCheckpointError(
                    f"{self._where()}: loading tensor {name} (shape {tuple(loaded_weight.shape)}, "
                    f"shard {shard!r}) failed: {type(e).__name__}: {e}") from e
            self.loaded.setdefault(name, set()).update(self._parts(shard))
            return out

        return load

    def _check_complete(self) -> None:
        for name in self._required():
            have = self.loaded.get(name, set())
            for idx in range(len(self.partition_sizes)):
                if idx not in have:
                    self._fail(f"missing tensor: the checkpoint has no {name} for {self._shard_label(idx)}")

    def _required(self) -> tuple[str, ...]:
        raise NotImplementedError

    def _scale_names(self) -> tuple[str, ...]:
        return self.convention.param_names(self.fmt)[1:]

    # ---------------------------------------------------------------------------- weights
    def _register(self, layer, name, shape, dtype, cls, loader, **dims):
        param = cls(data=torch.empty(shape, dtype=dtype), weight_loader=self._checked_loader(layer, name, loader),
                    **dims)
        layer.register_parameter(name, param)

    def create_weights(self, layer, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       **extra_weight_attrs) -> None:
        loader = extra_weight_attrs.get("weight_loader")
        self.partition_sizes = [int(s) for s in output_partition_sizes]
        self.n, self.k = sum(self.partition_sizes), int(input_size_per_partition)
        layer.logical_widths = list(output_partition_sizes)
        layer.input_size_per_partition = input_size_per_partition
        layer.output_size_per_partition = self.n
        self._create(layer, loader)

    def _create(self, layer, loader) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer) -> None:
        self._check_complete()
        self._prepack(layer)
        for name in self._param_names():
            if name in layer._parameters:
                delattr(layer, name)
        self.census_name = CENSUS.register_module(layer, self.prefix, self.fmt, self.n, self.k,
                                                  eligible=True, prepack_verified=bool(self.pieces),
                                                  declared=self.declared)
        self.op_id = _register_method(self)
        if isinstance(layer, VocabParallelEmbedding):
            CENSUS.set_lm_head(module=self.census_name, region=self.fmt, source=self.weight_source(),
                               route_family=self.format.route_prefix,
                               repack_fallback=not self._served_from_packed_codes())

    def _param_names(self) -> tuple[str, ...]:
        """Every parameter this method registered (freed once the prepack is proven)."""
        return self.convention.param_names(self.fmt)

    def weight_source(self) -> str:
        """What the loader did for this module's weights, as the census reports it:
        ``checkpoint_codes`` when the checkpoint delivered codes and scales for every output shard
        through our checked loader and the packed buffers were proven byte-identical to them."""
        shards = set(range(len(self.partition_sizes)))
        received = all(shards <= self.loaded.get(name, set()) for name in self._required())
        if not received:
            return "not_from_checkpoint"
        return "checkpoint_codes" if self._served_from_packed_codes() else "checkpoint_unverified"

    def _served_from_packed_codes(self) -> bool:
        # pieces are set only after every piece's inverse permutation matched the loaded bytes
        covered = sum(r1 - r0 for r0, r1, _ in self.pieces)
        return bool(self.pieces) and covered == self.n

    def _prepack(self, layer) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------------------ apply
    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # One opaque custom op per call: torch.compile traces through it without looking inside,
        # so the route choice (from the real M) and the census count run at every call, eager or
        # during CUDA-graph capture, exactly as in eager mode.
        lead = x.shape[:-1]
        y = torch.ops.qpn_loader.linear(x.reshape(-1, x.shape[-1]), self.op_id)
        if bias is not None:
            y = y + bias
        return y.reshape(*lead, self.n)

    def run(self, x2: torch.Tensor) -> torch.Tensor:
        """The body of the custom op: route by M, compute, count."""
        from qpn.kernels.routes import route_for

        if self._ops is None:
            from qpn.kernels import ops

            self._ops = ops
        m = x2.shape[0]
        if m == 0:
            return x2.new_empty((0, self.n))
        # a staged family (registered, not served: kernels/formats.py) has its routes in the unserved table only
        route = route_for(self.fmt, m, self.n, self.k, arch=self.arch, served_only=self.format.served)
        if len(self.pieces) == 1:
            y = self._ops.qpn_linear(x2, self.pieces[0][2], route=route)
        else:
            y = torch.cat([self._ops.qpn_linear(x2, p, route=route) for _, _, p in self.pieces], dim=-1)
        CENSUS.count(self.census_name, route, graph=_capturing_cuda_graph())
        return y if y.dtype == x2.dtype else y.to(x2.dtype)


_METHODS: list[_QPNLinearMethod] = []


def _register_method(method: _QPNLinearMethod) -> int:
    _METHODS.append(method)
    return len(_METHODS) - 1


@torch.library.custom_op("qpn_loader::linear", mutates_args=())
def _qpn_loader_linear(x: torch.Tensor, op_id: int) -> torch.Tensor:
    return _METHODS[op_id].run(x)


@_qpn_loader_linear.register_fake
def _(x: torch.Tensor, op_id: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], _METHODS[op_id].n))


@register_weight_loader_v2_supported_method
class QPN2LinearMethod(_QPNLinearMethod):
    """NVFP4 region -> QPN2 family (W4A16: e2m1 codes x e4m3 group scale x global scale)."""

    weight_format = formats.NVFP4
    fmt = weight_format.family

    def _expected_dtype(self, name):
        n = self.convention.names(self.format)
        return {n.codes: (torch.uint8,), n.group_scales: (torch.float8_e4m3fn,)}.get(
            name, (torch.float32, torch.bfloat16, torch.float16))

    def _expected_cols(self, name, k_full):
        n = self.convention.names(self.format)
        return {n.codes: k_full // 2, n.group_scales: k_full // GROUP_SIZE}.get(name)

    def _required(self):
        n = self.convention.names(self.format)
        return (n.codes, n.group_scales, n.global_scale)

    def _create(self, layer, loader) -> None:
        if self.k % GROUP_SIZE:
            self._fail(f"K={self.k} input features is not a multiple of {GROUP_SIZE} (the NVFP4 "
                       f"group size: one e4m3 scale per {GROUP_SIZE} inputs); this checkpoint cannot "
                       "be NVFP4 as declared")
        p = len(self.partition_sizes)
        n = self.convention.names(self.format)
        self._register(layer, n.codes, (self.n, self.k // 2), torch.uint8, ModelWeightParameter, loader,
                       input_dim=1, output_dim=0)
        self._register(layer, n.group_scales, (self.n, self.k // GROUP_SIZE), torch.float8_e4m3fn,
                       ModelWeightParameter, loader, input_dim=1, output_dim=0)
        self._register(layer, n.global_scale, (p,), torch.float32, PerTensorScaleParameter, loader)
        self._register(layer, n.input_scale, (p,), torch.float32, PerTensorScaleParameter, loader)

    def _prepack(self, layer) -> None:

        n = self.convention.names(self.format)
        w = getattr(layer, n.codes).data
        s = getattr(layer, n.group_scales).data
        stored = getattr(layer, n.global_scale).data
        if bool((stored == 0).any()):
            self._fail(f"{n.global_scale} (global scale) is 0 for a shard; re-export the checkpoint")
        s2 = self.convention.global_scale_f32(stored)  # one float32 multiplier per shard
        # Runs of shards that share one global scale become one packed piece.
        runs: list[list[int]] = []
        for i in range(len(self.partition_sizes)):
            if runs and torch.equal(s2[runs[-1][0]], s2[i]):
                runs[-1].append(i)
            else:
                runs.append([i])
        pieces = []
        for run in runs:
            r0 = sum(self.partition_sizes[: run[0]])
            r1 = sum(self.partition_sizes[: run[-1] + 1])
            src = (w[r0:r1], s[r0:r1], s2[run[0]].reshape(()))
            pieces.append((r0, r1, self._prepack_proven(src, f"{r0}-{r1 - 1}")))
        if len(pieces) > 1:
            logger.info("volta-qpn: %s: %d fused NVFP4 shards with different global scales served "
                        "as %d packed pieces (codes and scales unchanged)", self.prefix,
                        len(self.partition_sizes), len(pieces))
        self.pieces = pieces


@register_weight_loader_v2_supported_method
class QPN8LinearMethod(_QPNLinearMethod):
    """FP8 (e4m3) region -> QPN8 family (W8A16: e4m3 codes x per-tensor/per-channel scale)."""

    weight_format = formats.FP8_TENSOR
    fmt = weight_format.family

    def _expected_dtype(self, name):
        return {self.convention.names(self.format).codes: (torch.float8_e4m3fn,)}.get(
            name, (torch.float32, torch.bfloat16, torch.float16))

    def _expected_cols(self, name, k_full):
        n = self.convention.names(self.format)
        if name == n.scale and self.fp8_scale == "channel":
            return 1  # one scale per output row, stored [N, 1]
        return {n.codes: k_full}.get(name)

    def _required(self):
        n = self.convention.names(self.format)
        return (n.codes, n.scale)

    def _create(self, layer, loader) -> None:
        p = len(self.partition_sizes)
        n = self.convention.names(self.format)
        self._register(layer, n.codes, (self.n, self.k), torch.float8_e4m3fn, ModelWeightParameter, loader,
                       input_dim=1, output_dim=0)
        if self.fp8_scale == "channel":
            self._register(layer, n.scale, (self.n, 1), torch.float32, ChannelQuantScaleParameter, loader,
                           output_dim=0)
        else:
            self._register(layer, n.scale, (p,), torch.float32, PerTensorScaleParameter, loader)
        self._register(layer, n.input_scale, (p,), torch.float32, PerTensorScaleParameter, loader)

    def _prepack(self, layer) -> None:

        n = self.convention.names(self.format)
        w = getattr(layer, n.codes).data
        ws = getattr(layer, n.scale).data.float()
        if self.fp8_scale == "channel":
            scale = ws.reshape(-1).contiguous()  # already one scale per output row
        elif bool((ws == ws[0]).all()):
            scale = ws[:1].clone()
        else:
            # Each shard keeps its own scale: repeat it over the shard's rows (no requantization).
            scale = torch.repeat_interleave(
                ws, torch.tensor(self.partition_sizes, device=ws.device)).contiguous()
        self.pieces = [(0, self.n, self._prepack_proven((w, scale)))]


# The stored dtypes of each INT4 role: conventions.INT4_STORED_DTYPES (the safetensors names the
# launcher checks before boot), as the torch dtypes the loaded tensors have.
_TORCH_DTYPE = {"I32": torch.int32, "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16,
                "F32": torch.float32}
_INT4_DTYPES = {role: tuple(_TORCH_DTYPE[d] for d in names) for role, names in INT4_STORED_DTYPES.items()}
_NIBBLES = 8  # 4-bit values per int32 word: the "/8" of a layout symbol


def _pack_words(values: torch.Tensor, dim: int, order) -> torch.Tensor:
    """Integer values 0..15 -> int32 words of eight along ``dim``, nibble j = element 8c + order[j]:
    the convention's own packing, so the loaded words can be compared with what was served."""
    v = values.to(torch.int64)
    if dim == 0:
        return _pack_words(v.t(), 1, order).t().contiguous()
    rows, cols = v.shape
    if cols % _NIBBLES:
        v = torch.cat([v, v.new_zeros(rows, -cols % _NIBBLES)], 1)
    v = v.view(rows, -1, _NIBBLES)
    word = torch.zeros(v.shape[:2], dtype=torch.int64, device=v.device)
    for j, src in enumerate(order):
        word |= v[:, :, src] << (4 * j)
    return (word - ((word >> 31) << 32)).to(torch.int32)


@register_weight_loader_v2_supported_method
class QPN4LinearMethod(_QPNLinearMethod):
    """INT4 W4A16 region -> QPN4 family: unsigned 4-bit codes x float16 group scale, less a uint4
    zero point per group (asymmetric) or 8 (symmetric), from an AutoAWQ, GPTQ or compressed-tensors
    pack-quantized checkpoint (qpn.fork_patches.quant.conventions.INT4_CONVENTIONS).

    The parameters are the convention's tensors as stored (names and layout from its
    ``INT4Convention``: which axis is N or K, which one is packed eight per int32, which one holds
    one entry per group), as vLLM's parameter classes, so the engine's fused and tensor-parallel
    loaders narrow them per shard and per rank as they do for its own INT4 methods. Scales are kept
    in float32 until the prepack (any fp16 / bf16 / fp32 checkpoint value fits exactly); the family
    unpacker then refuses one float16 cannot hold."""

    weight_format = formats.INT4
    fmt = weight_format.family

    def __init__(self, prefix: str, convention: INT4Convention, scheme: INT4Scheme, backend: str,
                 arch: str = "sm70", atom: str = "m8n8k4", shard_names: list[str] | None = None,
                 declared: list[str] | None = None) -> None:
        super().__init__(prefix, convention.name, backend, arch=arch, atom=atom, shard_names=shard_names,
                         declared=declared)
        self.int4 = convention
        self.scheme = scheme
        self.k_full = 0
        self.g_idx: dict[int, torch.Tensor] = {}  # output part -> this rank's g_idx as loaded

    @property
    def format(self) -> formats.WeightFormat:
        return self.scheme.format

    def _where(self) -> str:
        return (f"{self.prefix} ({self.int4.name} {self.format.title}, group {self.scheme.group_size}, "
                f"{self.format.method_family} route family)")

    # ------------------------------------------------------------------------ names
    def _roles(self) -> dict[str, str]:
        """{role: tensor name} of every tensor the convention may store for this module. A symmetric
        GPTQ checkpoint still carries qzeros (unread), and GPTQ a trivial g_idx: both are registered
        so that the engine's loader finds a parameter for every tensor of the module."""
        n = self.int4.names
        return n.roles()

    def _param_names(self) -> tuple[str, ...]:
        return tuple(self._roles().values())

    def _required(self) -> tuple[str, ...]:
        roles = self._roles()
        return tuple(roles[r] for r, required in self.int4.roles(self.scheme).items() if required)

    def _role_of(self, name: str) -> str:
        return next(r for r, n in self._roles().items() if n == name)

    # --------------------------------------------------------------------- checking
    def _check_tensor(self, layer, name: str, t: torch.Tensor, shard) -> None:
        role = self._role_of(name)
        parts = self._parts(shard)
        what = f"tensor {name} ({role}) of " + ", ".join(self._shard_label(i) for i in parts)
        if t.dtype not in _INT4_DTYPES[role]:
            self._fail(f"{what} is stored as {t.dtype}, expected "
                       f"{' or '.join(str(d) for d in _INT4_DTYPES[role])} ({self.int4.name} layout)")
        rows, g = self._expected_rows(layer, shard), self.scheme.group_size
        want = self.int4.layout.dims(rows, self.k_full, g)[role]
        if tuple(t.shape) != want:
            self._fail(f"{what} has shape {tuple(t.shape)}, expected {want} = "
                       f"[{', '.join(getattr(self.int4.layout, role))}] for N={rows}, K={self.k_full}, "
                       f"group {g}")
        if role == "shape" and [int(v) for v in t.reshape(-1)] != [rows, self.k_full]:
            self._fail(f"{what} says the module is {[int(v) for v in t.reshape(-1)]}, the layer expects "
                       f"[{rows}, {self.k_full}] for this shard")
        if role == "g_idx":
            try:
                self.int4.check_g_idx(self.prefix, t, self.k_full, self.scheme)
            except ConventionError as e:
                self._fail(f"{what}: {e}")
        if role == "group_scales":
            v = t.float()
            n_bad = int((~torch.isfinite(v)).sum())
            if n_bad:
                self._fail(f"{what} is not finite: {n_bad} NaN / inf value(s) out of {v.numel()}; re-export "
                           "the checkpoint")
            if bool((v < 0).any()):
                self._fail(f"{what} holds negative scale(s); scales must be >= 0")
            if not bool((t.to(torch.float16).to(t.dtype) == t).all()):
                self._fail(f"{what} ({t.dtype}) holds values float16 cannot represent exactly; the INT4 "
                           "kernels read float16 scales and would change the weights")

    def _checked_loader(self, layer, name: str, loader):
        inner = super()._checked_loader(layer, name, loader)
        if self._role_of(name) != "g_idx":
            return inner

        def load(param, loaded_weight, *args, **kwargs):
            # One g_idx parameter serves every fused shard, so each shard's map (this rank's
            # slice, as the engine narrowed it) is kept the moment it arrives.
            out = inner(param, loaded_weight, *args, **kwargs)
            shard = args[0] if args else kwargs.get("loaded_shard_id")
            for idx in self._parts(shard):
                self.g_idx[idx] = param.data.clone()
            return out

        return load

    # ---------------------------------------------------------------------- weights
    def create_weights(self, layer, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       **extra_weight_attrs) -> None:
        self.k_full = int(input_size)  # before any row-parallel split: what the checkpoint stores
        super().create_weights(layer, input_size_per_partition, output_partition_sizes, input_size,
                               output_size, params_dtype, **extra_weight_attrs)

    def _create(self, layer, loader) -> None:
        g = self.scheme.group_size
        roles = self._roles()
        if self.k % g:
            if self.k != self.k_full:
                tp = self.k_full // self.k if self.k else 0
                fits = [t for t in range(1, 9) if self.k_full % t == 0 and (self.k_full // t) % g == 0]
                self._fail(f"row-parallel K={self.k_full} split over TP={tp} gives {self.k} inputs per rank, "
                           f"which breaks an INT4 group of {g} inputs (one scale"
                           f"{'' if self.scheme.symmetric else ' and zero point'} per group); fix: serve at a "
                           f"TP size that keeps whole groups (TP in {fits}) or use a checkpoint quantized with "
                           f"a group size that divides {self.k}")
            self._fail(f"K={self.k} input features is not a multiple of the group size {g}")
        packs_n = self.int4.packs_outputs(self.scheme)
        for idx, rows in enumerate(self.partition_sizes):
            if packs_n and rows % _NIBBLES:
                self._fail(f"{self._shard_label(idx)} has {rows} rows on this rank; {self.int4.name} packs "
                           f"{_NIBBLES} output rows per int32 word, so every shard on every rank needs a "
                           f"multiple of {_NIBBLES} rows (fix: a TP size that keeps it)")
        dims = self.int4.layout.dims(self.n, self.k, g)
        for role, name in roles.items():
            syms = getattr(self.int4.layout, role)
            shape = dims[role]
            if role == "shape":
                self._register(layer, name, shape, torch.int64, BasevLLMParameter, loader)
                continue
            in_dim = next(i for i, s in enumerate(syms) if s.startswith("K"))
            if len(syms) == 1:
                self._register(layer, name, shape, torch.int32, RowvLLMParameter, loader, input_dim=in_dim)
                continue
            out_dim = next(i for i, s in enumerate(syms) if s.startswith("N"))
            packed = [i for i, s in enumerate(syms) if s.endswith(f"/{_NIBBLES}")]
            if packed:
                self._register(layer, name, shape, torch.int32, PackedvLLMParameter, loader, input_dim=in_dim,
                               output_dim=out_dim, packed_dim=packed[0], packed_factor=_NIBBLES)
            else:
                self._register(layer, name, shape, torch.float32, GroupQuantScaleParameter, loader,
                               input_dim=in_dim, output_dim=out_dim)

    def _layout_tensors(self, codes, scales, zeros) -> dict[str, torch.Tensor]:
        """The canonical source written back in the convention's layout: compared with the loaded
        tensors, it proves the unpacker read every word as the convention stores it."""
        lay, roles = self.int4.layout, self._roles()

        def orient(t, syms):  # canonical tensors are [N, *]; a layout may store [K, N]
            return t.t() if syms[0].startswith("K") else t

        def words(values, syms):
            v = orient(values, syms)
            return _pack_words(v, next(i for i, s in enumerate(syms) if s.endswith(f"/{_NIBBLES}")),
                               lay.nibble_order)

        out = {roles["codes"]: words(int4_codec.unpack_codes(codes), lay.codes),
               roles["group_scales"]: orient(scales, lay.group_scales).float()}
        if zeros is not None:
            out[roles["zero_points"]] = words(zeros.to(torch.int64) - self.scheme.zero_offset, lay.zero_points)
        return out

    def _prepack(self, layer) -> None:
        import dataclasses


        roles, g = self._roles(), self.scheme.group_size
        keep = ["codes", "group_scales"] + ([] if self.scheme.symmetric else ["zero_points"])
        tensors = {roles[r]: getattr(layer, roles[r]).data for r in keep}
        # g_idx is applied per shard below (fused shards each carry their own)
        scheme = dataclasses.replace(self.scheme, act_order=False)
        try:
            src = self.int4.int4_inputs(tensors, self.prefix, scheme)
        except ConventionError as e:
            self._fail(f"cannot unpack: {e}")
        codes, scales = src[0], src[1]
        zeros = None if self.scheme.symmetric else src[2]
        for name, want in self._layout_tensors(codes, scales, zeros).items():
            got = tensors[name]
            if got.shape != want.shape or not torch.equal(got, want.to(got.dtype)):
                self._fail(f"the unpacked {name} does not give the loaded tensor back; the checkpoint does "
                           f"not follow the {self.int4.name} layout")
        if self.g_idx:
            scales, zeros = scales.clone(), None if zeros is None else zeros.clone()
            # a rank of a row-parallel layer holds groups from its own offset on
            first = 0 if self.k == self.k_full else int(layer.tp_rank) * (self.k // g)
            for idx, gi in sorted(self.g_idx.items()):
                r0 = sum(self.partition_sizes[:idx])
                r1 = r0 + self.partition_sizes[idx]
                try:
                    s, z = int4_checkpoint.apply_g_idx(scales[r0:r1], None if zeros is None else zeros[r0:r1],
                                                       gi.to(torch.int64) - first, g, self.prefix)
                except formats.FormatError as e:
                    self._fail(f"{self._shard_label(idx)}: {e}")
                scales[r0:r1] = s
                if zeros is not None:
                    zeros[r0:r1] = z
        src = (codes, scales) if zeros is None else (codes, scales, zeros)
        self.pieces = [(0, self.n, self._prepack_proven(src))]
        self.g_idx = {}


def int4_method_for(convention: INT4Convention | str, layer, prefix: str, target: dict, group_size: int,
                    symmetric: bool, *, zero_offset: int = 0, act_order: bool = False,
                    shard_names: list[str] | None = None, declared: list[str] | None = None,
                    source: str = "") -> QPN4LinearMethod:
    """The QPN4 method of one INT4 module, for the config side (qpn_config.qpn_method).

    ``convention``: conventions.AWQ / GPTQ / CT_PACK_QUANTIZED or its name; ``target``:
    platform_gate.serving_target() ({"backend", "arch", "atom"}); ``group_size``, ``symmetric``,
    ``zero_offset`` (GPTQ v1: 1) and ``act_order`` as the module's conventions.INT4Scheme has
    them; ``shard_names``: the packed_modules_mapping entry of the layer's leaf (fused shards).
    QPNCheckpointError names the module for a scheme the family does not serve."""
    conv = INT4_CONVENTIONS.get(convention) if isinstance(convention, str) else convention
    if conv is None:
        raise QPNCheckpointError(f"{prefix}: unknown INT4 convention {convention!r}; expected one of "
                                 f"{sorted(INT4_CONVENTIONS)}")
    scheme = INT4Scheme(bool(symmetric), int(group_size), zero_offset=int(zero_offset), act_order=bool(act_order),
                        source=source)
    if scheme.group_size not in scheme.format.group_sizes:
        raise QPNCheckpointError(f"{prefix} ({conv.name}): group size {group_size} is not one the INT4 family "
                                 f"packs ({', '.join(map(str, scheme.format.group_sizes))})")
    return QPN4LinearMethod(prefix, conv, scheme, backend=target["backend"], arch=target.get("arch", "sm70"),
                            atom=target.get("atom", "m8n8k4"), shard_names=shard_names, declared=declared)


METHODS = {cls.fmt: cls for cls in (QPN2LinearMethod, QPN8LinearMethod, QPN4LinearMethod)}


def method_class(fmt: formats.WeightFormat | str) -> type[_QPNLinearMethod]:
    """The linear method class serving a weight format (its kernel family's method)."""
    return METHODS[formats.weight_format(fmt).family]
