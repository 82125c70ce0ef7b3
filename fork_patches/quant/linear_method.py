"""The QPN linear method: one class for every weight family and checkpoint convention.

Life of one quantized module (vLLM's LinearMethodBase contract):

1. ``create_weights``: register the checkpoint's tensors exactly as stored. Which tensors, their
   dtypes and their stored shapes (in symbols of N, K, the group size and the fused shards) are the
   family's loader schema (kernels/families/<family>/loader.py, ``families.loader(fmt)``) under
   the convention's tensor names (qpn.fork_patches.quant.conventions); vLLM's parameter class of
   each follows from its symbols, so the engine's fused and tensor-parallel loaders narrow them per
   shard and per rank as they do for its own methods. Every tensor is checked as it is loaded
   (dtype, shape, finite and non-negative scales, and what the family adds) and every shard that
   received it is recorded, so a broken checkpoint fails the load with an error that names the
   module, the shard and the problem.
2. ``process_weights_after_loading``: every shard must have its required tensors; the family's
   schema turns them into sources (shard fusion: NVFP4 shards with different global scales become
   separate pieces, FP8 shards with different scales a per-row scale vector, INT4 words unpacked
   and proven to give the loaded words back); each piece is prepacked, its inverse proven byte for
   byte, and only then are the source tensors freed. No FP16 copy of a weight is made at any
   point, and nothing is requantized.
3. ``apply``: one custom op (``qpn_loader::linear``, opaque to torch.compile) whose body takes
   M = rows in the batch, route = qpn.kernels.routes.route_for(fmt, M, N, K), runs
   qpn.kernels.ops.qpn_linear(x, packed, route) and counts the call in the route census (calls
   made while capturing a CUDA graph counted separately; a graph replay runs no Python, so
   replays are not counted).

The same method serves ``lm_head`` (vLLM's LogitsProcessor calls ``lm_head.quant_method.apply``),
so the head runs from the checkpoint's own codes. Activation scales (``input_scale``) are loaded,
checked and dropped: QPN computes with FP16 activations (W4A16 / W8A16).
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
    PackedColumnParameter,
    PackedvLLMParameter,
    PerTensorScaleParameter,
    RowvLLMParameter,
)

from qpn.fork_patches.quant.conventions import MODELOPT, Convention, ModuleScheme
from qpn.fork_patches.route_census.census import CENSUS
from qpn.kernels import families, formats, prepack
from qpn.kernels.families.contract import LoadError, StoredTensor

logger = logging.getLogger("vllm.qpn.linear_method")


class QPNCheckpointError(ValueError):
    """A checkpoint tensor or declaration the QPN path cannot serve; names module and problem."""


def _capturing_cuda_graph() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _param_class(spec: StoredTensor):
    """(vLLM parameter class, its dims) for a stored tensor, from its symbols: the engine's fused
    and tensor-parallel loaders narrow a parameter by the dims its class declares."""
    syms = spec.symbols
    if syms == ("P",):   # one value per fused output shard
        return PerTensorScaleParameter, {}
    if len(syms) == 1:
        if syms[0].startswith("K"):  # one entry per input (a g_idx): split with the inputs
            return RowvLLMParameter, {"input_dim": 0}
        return BasevLLMParameter, {}  # a fixed-size record (compressed-tensors' weight_shape)
    out_dim = next(i for i, s in enumerate(syms) if s.startswith("N"))
    k_dims = [i for i, s in enumerate(syms) if s.startswith("K")]
    if spec.packed_factor:
        packed = {"packed_dim": next(i for i, s in enumerate(syms) if s.endswith(f"/{spec.packed_factor}")),
                  "packed_factor": spec.packed_factor}
        if not k_dims:  # packed along the outputs, one entry per row (per-channel zero points)
            return PackedColumnParameter, {"output_dim": out_dim, **packed}
        return PackedvLLMParameter, {"input_dim": k_dims[0], "output_dim": out_dim, **packed}
    if not k_dims:  # one value per output row
        return ChannelQuantScaleParameter, {"output_dim": out_dim}
    dims = {"input_dim": k_dims[0], "output_dim": out_dim}
    if "K/g" in syms:
        return GroupQuantScaleParameter, dims
    return ModelWeightParameter, dims


class QPNLinearMethod(LinearMethodBase):
    """The QPN linear method of one quantized module, for every weight family: what differs between
    families is their loader schema (``families.loader(fmt)``, kernels/families/<family>/loader.py)
    and numerics; what differs between checkpoint conventions is the convention object (tensor
    names, stored layout, scale rules).

    ``scheme``: what the config declares for the module (conventions.ModuleScheme); its ``format``
    is the member the module is served as."""

    def __init__(self, prefix: str, scheme, backend: str, convention: Convention | None = None,
                 arch: str = "sm70", atom: str = "m8n8k4", shard_names: list[str] | None = None,
                 declared: list[str] | None = None) -> None:
        self.prefix = prefix
        self.scheme = scheme
        self.convention = convention or MODELOPT
        self.declared = declared  # the checkpoint's module names this module serves
        self.backend = backend
        self.arch = arch
        self.atom = atom  # the fragment order the weights are prepacked in
        self.shard_names = list(shard_names or [])
        self.fmt = self.format.family  # census region, route family, packed layout
        self.names = self.convention.names(self.format)
        self.schema = families.loader(self.format)
        self.stored = {spec.name: spec for spec in self.schema.stored(self.names, self.convention, scheme)}
        self.partition_sizes: list[int] = []
        self.n = self.k = self.k_full = 0
        self.loaded: dict[str, set[int]] = {}
        self.kept: dict[str, dict[int, torch.Tensor]] = {}  # role -> {part: the shard's map as loaded}
        self.pieces: list[tuple[int, int, object]] = []  # (row0, row1, packed)
        self.census_name: str | None = None
        self.op_id: int | None = None
        self._ops = None

    # ------------------------------------------------------------------------- descriptions
    @property
    def format(self) -> formats.WeightFormat:
        """This module's numeric format (the family member its scheme declares)."""
        return self.scheme.format

    def where(self) -> str:
        """The module, its convention, format and route family, as every error names them."""
        g = self.scheme.group_size
        group = (", per channel" if g == -1 else f", group {g}") if self.format.group_sizes else ""
        return (f"{self.prefix} ({self.convention.name} {self.format.title}{group}, "
                f"{self.format.method_family} route family)")

    def shard_label(self, idx: int) -> str:
        """Output shard ``idx`` of the fused module, with its rows and checkpoint module name."""
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
        raise QPNCheckpointError(f"{self.where()}: {msg}")

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

    def required(self) -> tuple[str, ...]:
        """The tensor names every output shard must receive before the prepack."""
        return tuple(name for name, spec in self.stored.items() if spec.required)

    def check_tensor(self, layer, name: str, t: torch.Tensor, shard) -> None:
        """Refuse a loaded tensor (naming module, shard and problem) whose dtype, shape or values
        are not what the convention and scheme declare."""
        spec = self.stored[name]
        what = f"tensor {name} ({spec.role}) of " + ", ".join(self.shard_label(i) for i in self._parts(shard))
        if t.dtype not in spec.accepted:
            self._fail(f"{what} is stored as {t.dtype}, expected {' or '.join(str(d) for d in spec.accepted)}; "
                       f"the checkpoint does not hold {self.format.title} data for this module as "
                       f"{self.convention.name} stores it")
        rows, g = self._expected_rows(layer, shard), self.scheme.group_size
        if spec.symbols == ("P",):  # a per-shard scalar
            if t.numel() != 1:
                self._fail(f"{what} has shape {tuple(t.shape)}; a per-tensor scale must hold one value")
        else:
            want = spec.shape(rows, self.k_full, g)
            if tuple(t.shape) != want:
                self._fail(f"{what} has shape {tuple(t.shape)}, expected {want} = [{', '.join(spec.symbols)}] "
                           f"for N={rows}, K={self.k_full}" + (f", group {g}" if "K/g" in spec.symbols else ""))
        if spec.scale:
            v = t.float()
            n_nan, n_inf = int(torch.isnan(v).sum()), int(torch.isinf(v).sum())
            if n_nan or n_inf:
                self._fail(f"{what} is not finite: {n_nan} NaN and {n_inf} inf value(s) out of {v.numel()}; "
                           "re-export the checkpoint")
            if bool((v < 0).any()):
                self._fail(f"{what} holds negative scale(s); scales must be >= 0")
        problem = self.schema.value_problem(spec, t, rows, self.k_full, self.convention, self.scheme, self.prefix)
        if problem:
            self._fail(f"{what} {problem}")

    def _checked_loader(self, layer, name: str, loader):
        spec = self.stored[name]

        def load(param, loaded_weight, *args, **kwargs):
            shard = args[0] if args else kwargs.get("loaded_shard_id")
            self.check_tensor(layer, name, loaded_weight, shard)
            try:
                out = loader(param, loaded_weight, *args, **kwargs)
            except (AssertionError, RuntimeError, ValueError, IndexError) as e:
                raise QPNCheckpointError(
                    f"{self.where()}: loading tensor {name} (shape {tuple(loaded_weight.shape)}, "
                    f"shard {shard!r}) failed: {type(e).__name__}: {e}") from e
            self.loaded.setdefault(name, set()).update(self._parts(shard))
            if spec.symbols == ("K",):
                # One per-input parameter (a g_idx) serves every fused shard, so each shard's map
                # (this rank's slice, as the engine narrowed it) is kept the moment it arrives.
                for idx in self._parts(shard):
                    self.kept.setdefault(spec.role, {})[idx] = param.data.clone()
            return out

        return load

    def _check_complete(self) -> None:
        for name in self.required():
            have = self.loaded.get(name, set())
            for idx in range(len(self.partition_sizes)):
                if idx not in have:
                    self._fail(f"missing tensor: the checkpoint has no {name} for {self.shard_label(idx)}")

    # ---------------------------------------------------------------------------- weights
    def create_weights(self, layer, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       **extra_weight_attrs) -> None:
        loader = extra_weight_attrs.get("weight_loader")
        self.partition_sizes = [int(s) for s in output_partition_sizes]
        self.n, self.k = sum(self.partition_sizes), int(input_size_per_partition)
        self.k_full = int(input_size)  # before any row-parallel split: what the checkpoint stores
        layer.logical_widths = list(output_partition_sizes)
        layer.input_size_per_partition = input_size_per_partition
        layer.output_size_per_partition = self.n
        problem = self.schema.geometry_problem(self.partition_sizes, self.k, self.k_full, self.convention,
                                               self.scheme)
        if problem:
            self._fail(problem)
        p, g = len(self.partition_sizes), self.scheme.group_size
        for name, spec in self.stored.items():
            shape = spec.shape(self.n, self.k, g, parts=p)
            cls, dims = _param_class(spec)
            param = cls(data=torch.empty(shape, dtype=spec.dtype),
                        weight_loader=self._checked_loader(layer, name, loader), **dims)
            layer.register_parameter(name, param)

    def process_weights_after_loading(self, layer) -> None:
        self._check_complete()
        self.prepack(layer)
        for name in self.stored:
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

    def prepack(self, layer) -> None:
        """The module's packed pieces from the tensors loaded into ``layer`` (anything with the
        parameters as attributes): the family's schema makes the sources (shard fusion), and each
        piece is prepacked with its inverse proven byte for byte before ``pieces`` is set."""
        tensors = {spec.role: getattr(layer, name).data for name, spec in self.stored.items()
                   if getattr(layer, name, None) is not None}
        # a row-parallel rank's per-input maps (g_idx) start at its own first group
        g = self.scheme.group_size
        first = int(layer.tp_rank) * (self.k // g) if self.kept and g > 0 and self.k != self.k_full else 0
        try:
            sources = self.schema.sources(tensors, self.partition_sizes, self.names, self.convention, self.scheme,
                                          self.prefix, {**self.kept, "first_group": first})
        except LoadError as e:
            self._fail(str(e))
        pieces = [(r0, r1, self._prepack_proven(src, f"{r0}-{r1 - 1}" if len(sources) > 1 else ""))
                  for r0, r1, src in sources]
        if len(pieces) > 1:
            logger.info("volta-qpn: %s: %d fused %s shards served as %d packed pieces (codes and scales "
                        "unchanged)", self.prefix, len(self.partition_sizes), self.format.title, len(pieces))
        self.pieces, self.kept = pieces, {}

    def weight_source(self) -> str:
        """What the loader did for this module's weights, as the census reports it:
        ``checkpoint_codes`` when the checkpoint delivered codes and scales for every output shard
        through our checked loader and the packed buffers were proven byte-identical to them."""
        shards = set(range(len(self.partition_sizes)))
        received = all(shards <= self.loaded.get(name, set()) for name in self.required())
        if not received:
            return "not_from_checkpoint"
        return "checkpoint_codes" if self._served_from_packed_codes() else "checkpoint_unverified"

    def _served_from_packed_codes(self) -> bool:
        # pieces are set only after every piece's inverse permutation matched the loaded bytes
        covered = sum(r1 - r0 for r0, r1, _ in self.pieces)
        return bool(self.pieces) and covered == self.n

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


register_weight_loader_v2_supported_method(QPNLinearMethod)

_METHODS: list[QPNLinearMethod] = []


def _register_method(method: QPNLinearMethod) -> int:
    _METHODS.append(method)
    return len(_METHODS) - 1


@torch.library.custom_op("qpn_loader::linear", mutates_args=())
def _qpn_loader_linear(x: torch.Tensor, op_id: int) -> torch.Tensor:
    return _METHODS[op_id].run(x)


@_qpn_loader_linear.register_fake
def _(x: torch.Tensor, op_id: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], _METHODS[op_id].n))


def qpn_linear_method(prefix: str, scheme, target: dict, convention: Convention | None = None,
                      shard_names: list[str] | None = None, declared: list[str] | None = None) -> QPNLinearMethod:
    """The QPN method of one module, for the config side (quant_config, ct_config, qpn_config).

    ``scheme``: a conventions.ModuleScheme, or a format / ModelOpt algo name;
    ``target``: platform_gate.serving_target() ({"backend", "arch", "atom"}); ``shard_names``: the
    packed_modules_mapping entry of the layer's leaf (fused shards). QPNCheckpointError names the
    module for a scheme its family does not serve."""
    if isinstance(scheme, str):
        scheme = ModuleScheme(formats.weight_format(scheme).family)
    fmt = scheme.format
    g = scheme.group_size
    if fmt.group_sizes and g not in fmt.group_sizes and not (g == -1 and fmt.channel_groups):
        raise QPNCheckpointError(f"{prefix} ({convention.name if convention else 'modelopt'}): group size {g} is "
                                 f"not one the {fmt.title} family packs ({', '.join(map(str, fmt.group_sizes))})")
    return QPNLinearMethod(prefix, scheme, backend=target["backend"], convention=convention,
                           arch=target.get("arch", "sm70"), atom=target.get("atom", "m8n8k4"),
                           shard_names=shard_names, declared=declared)
