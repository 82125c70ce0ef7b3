"""QPN MoE method: the routed experts of a ModelOpt NVFP4 (or FP8) MoE layer served by the grouped
QPN MoE kernels (qpn.kernels.moe) on SM70, and by their CPU reference over the same packed
buffers on the CPU engine.

``qpn_config.QPNConfig`` (the registered "qpn" quantization method) hands a routed-experts layer
this method where the engine asks the quant config for the experts' method: vLLM 0.32's
``RoutedExperts._get_quant_method`` through ``resolve_quant_method``, and 1Cat-vLLM 1.2.2 / 1.3.0's
closure in ``FusedMoE.__init__`` (``RoutedExperts`` is an alias of ``FusedMoE`` there), both calling
``quant_config.get_quant_method(layer, prefix)``. ModelOpt experts (``qpn_moe_method_for``) whose
declared algo is NVFP4 / W4A16_NVFP4 / FP8 get a ``QPNModelOptMoEMethod``; any other declared algo
fails the load naming the layer.

compressed-tensors experts (``qpn_ct_moe_method_for``): experts whose config group declares NVFP4
or FP8 (per tensor or per channel) get ``QPNCompressedTensorsMoEMethod``, the same method with the
compressed-tensors convention's names and global-scale rule (``weight_global_scale`` is a divisor:
inverted per expert and shard), loaded through the engine's generic expert loader. INT4 experts
(pack-quantized, AWQ, GPTQ) stay with the engine's own MoE method: QPN has no INT4 MoE kernels.

Life of one MoE layer (vLLM 0.32's FusedMoEMethodBase contract):

1. ``create_weights``: the checkpoint's expert tensors as ModelOpt stores them (vLLM's fused
   layout: w13 = [gate rows; up rows] per expert, w2 = down), registered under the names and
   shapes of vLLM's own ModelOpt MoE methods, so that ``RoutedExperts.weight_loader`` routes
   every per-expert tensor and per-tensor scale as it does for them (it keys on "ModelOpt" in
   the method's class name). Each tensor is checked as it arrives (dtype, finite, non-negative
   scales) and every (tensor, expert, shard) received is recorded.
2. ``process_weights_after_loading``: every local expert must have every tensor of both
   shards; then each expert's gate, up and down are prepacked with the dense path's prepack and
   its inverse verified byte for byte (qpn.kernels.moe.prepack_moe) before the source tensors
   are freed. gate and up keep their own global scales (vLLM's NVFP4 MoE path folds them into
   one and warns); no FP16 copy of an expert exists at any point.
3. ``apply``: vLLM's router gives topk_ids / topk_weights; with expert parallelism the global
   ids go through the layer's expert map (-1: not on this rank); qpn.kernels.moe.qpn_moe runs
   the grouped kernels (no host synchronisation: the layer stays CUDA-graph capturable) or,
   on CPU, the reference. Shared experts stay with vLLM's runner (they are linear layers,
   served by the loader's QPN linear methods). Every call is counted in the route census
   under both expert stacks of the layer (``<layer>.w13`` and ``<layer>.w2``).

The activation scales (``input_scale``) are loaded, checked and dropped: QPN computes with FP16
activations (W4A16 / W8A16).
"""
from __future__ import annotations

import logging

import torch
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.parameter import ModelWeightParameter, PerTensorScaleParameter

from qpn.fork_patches.route_census.census import CENSUS
from qpn.fork_patches.quant.conventions import COMPRESSED_TENSORS, MODELOPT, Convention, is_integer_weights
from qpn.fork_patches.quant.linear_method import QPNCheckpointError, _capturing_cuda_graph
from qpn.kernels import formats

logger = logging.getLogger("qpn.moe_method")

SERVED_ALGOS = ", ".join(formats.MODELOPT_ALGOS)


class QPNModelOptMoEMethod(FusedMoEMethodBase):
    """Routed experts of a ModelOpt NVFP4 / FP8 MoE layer on the grouped QPN MoE kernels.
    (The class name carries "ModelOpt" on purpose: vLLM's RoutedExperts.weight_loader selects
    its ModelOpt scale handling by that substring.)"""

    def __init__(self, moe_config, prefix: str, algo: str, backend: str, convention: Convention = MODELOPT,
                 fp8_scale: str = "tensor") -> None:
        super().__init__(moe_config)
        self.prefix = prefix
        self.algo = algo
        self.backend = backend
        self.format = formats.weight_format(algo, output_scale=fp8_scale)  # raises UnknownFormat
        self.fmt = self.format.family
        # tensor names and the global-scale rule of the checkpoint family (conventions.py)
        self.convention = convention
        if fp8_scale not in convention.fp8_scale_layouts:
            raise QPNCheckpointError(f"{prefix}: FP8 scales per {fp8_scale} are not a {convention.name} layout "
                                     f"({', '.join(convention.fp8_scale_layouts)})")
        self.fp8_scale = fp8_scale
        self.packed = None
        self.census_names: list[str] = []
        self.declared: list[str] = []  # set by qpn_moe_method_for from the checkpoint's map
        self.loaded: dict[str, set[tuple[int, str]]] = {}
        self.num_experts = 0
        self.hidden = self.inter = 0
        act = getattr(getattr(moe_config, "activation", None), "value", None)
        if not moe_config.is_act_and_mul or str(act).lower() not in ("silu", "swiglu"):
            raise QPNCheckpointError(
                f"{prefix}: the QPN MoE kernels compute SwiGLU experts (silu(gate) * up); this layer "
                f"uses activation {act!r} (gated: {moe_config.is_act_and_mul})")

    # --------------------------------------------------------------------------- contract
    def uses_weight_scale_2_pattern(self) -> bool:
        return self.format.output_scale == "global"

    def get_fused_moe_quant_config(self, layer):
        return None

    @property
    def method_name(self) -> str:
        return f"QPN MoE ({self.algo}, {self.fmt}, {self.convention.name})"

    def _where(self) -> str:
        return f"{self.prefix} ({self.algo} experts, QPN MoE)"

    def _fail(self, msg: str):
        raise QPNCheckpointError(f"{self._where()}: {msg}")

    # ---------------------------------------------------------------------------- weights
    def _names(self) -> dict[str, str]:
        """{role: parameter suffix} of this format in this convention (codes, group_scales,
        global_scale, input_scale for NVFP4; codes, scale, input_scale for FP8); vLLM's expert
        mapping turns checkpoint ``experts.{e}.gate_proj.<suffix>`` into ``w13_<suffix>``."""
        return self.convention.names(self.format).roles()

    def _optional(self) -> set[str]:
        """Parameters a checkpoint may leave out: compressed-tensors writes no input scale for
        weight-only NVFP4 (NVFP4A16) or dynamic FP8 activations. QPN never reads them."""
        if self.convention.name == MODELOPT.name:
            return set()
        return {f"w13_{self._names()['input_scale']}", f"w2_{self._names()['input_scale']}"}

    def _expected(self) -> dict[str, tuple[tuple, tuple[torch.dtype, ...]]]:
        e, h, i = self.num_experts, self.hidden, self.inter
        f32 = (torch.float32, torch.bfloat16, torch.float16)
        n = self._names()
        fmt = self.format
        codes = (getattr(torch, fmt.code_dtype),)
        out = {
            f"w13_{n['codes']}": ((e, 2 * i, fmt.code_cols(h)), codes),
            f"w2_{n['codes']}": ((e, h, fmt.code_cols(i)), codes),
        }
        if fmt.has_group_scales:
            out[f"w13_{n['group_scales']}"] = ((e, 2 * i, fmt.group_scale_cols(h)), (torch.float8_e4m3fn,))
            out[f"w2_{n['group_scales']}"] = ((e, h, fmt.group_scale_cols(i)), (torch.float8_e4m3fn,))
        if fmt.output_scale == "channel":
            out[f"w13_{n['scale']}"] = ((e, 2 * i, 1), f32)
            out[f"w2_{n['scale']}"] = ((e, h, 1), f32)
        else:  # one per shard: gate and up each have their own
            out[f"w13_{n['global_scale' if fmt.output_scale == 'global' else 'scale']}"] = ((e, 2), f32)
            out[f"w2_{n['global_scale' if fmt.output_scale == 'global' else 'scale']}"] = ((e,), f32)
        # compressed-tensors FP8: one static input scale per expert for w13 (vLLM's loader checks
        # that w1's and w3's agree), as vLLM's own compressed-tensors FP8 MoE method keeps it
        one_w13_input = self.convention.name != MODELOPT.name and not fmt.has_group_scales
        out[f"w13_{n['input_scale']}"] = ((e,) if one_w13_input else (e, 2), f32)
        out[f"w2_{n['input_scale']}"] = ((e,), f32)
        return out

    def _codes(self) -> tuple[str, str]:
        return f"w13_{self._names()['codes']}", f"w2_{self._names()['codes']}"

    def _loader_kind(self, name: str) -> str | None:
        """The ``quant_method`` attribute vLLM's generic expert loader dispatches on (the path
        its compressed-tensors MoE methods use): group scales, per-tensor (one per shard) or per
        channel; None for codes and for FP8 input scales (loaded by name)."""
        n = self._names()
        if name in self._codes():
            return None
        if self.format.has_group_scales:
            return "group" if name.endswith(f"_{n['group_scales']}") else "tensor"
        if name.endswith(f"_{n['input_scale']}"):
            return None
        return "channel" if self.fp8_scale == "channel" else "tensor"

    def _check_tensor(self, name: str, t: torch.Tensor, expert_id: int, shard_id: str) -> None:
        what = f"tensor {name} of expert {expert_id}, shard {shard_id}"
        _, dtypes = self._expected()[name]
        if t.dtype not in dtypes:
            declared = "quantized_layers" if self.convention.name == MODELOPT.name else "config_groups"
            self._fail(f"{what} is stored as {t.dtype}, expected {' or '.join(str(d) for d in dtypes)}; "
                       f"the checkpoint does not hold {self.algo} data for these experts (check {declared})")
        if name not in self._codes():  # every scale: e4m3 group scales, global, per-tensor, input
            v = t.float()
            n_nan, n_inf = int(torch.isnan(v).sum()), int(torch.isinf(v).sum())
            if n_nan or n_inf:
                self._fail(f"{what} is not finite: {n_nan} NaN and {n_inf} inf value(s) out of {v.numel()}; "
                           "re-export the checkpoint")
            if bool((v < 0).any()):
                self._fail(f"{what} holds negative scale(s); scales must be >= 0")

    def _checked_loader(self, name: str, loader):
        def load(param, loaded_weight, weight_name=None, shard_id=None, expert_id=None, return_success=False,
                 **kwargs):
            self._check_tensor(name, loaded_weight, expert_id, shard_id)
            try:
                ok = loader(param=param, loaded_weight=loaded_weight, weight_name=weight_name, shard_id=shard_id,
                            expert_id=expert_id, return_success=True, **kwargs)
            except (AssertionError, RuntimeError, ValueError, IndexError) as e:
                raise QPNCheckpointError(
                    f"{self._where()}: loading tensor {name} of expert {expert_id} (shard {shard_id}, shape "
                    f"{tuple(loaded_weight.shape)}) failed: {type(e).__name__}: {e}") from e
            if ok:
                self.loaded.setdefault(name, set()).add((int(expert_id), str(shard_id)))
            return ok if return_success else None

        return load

    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        if getattr(layer, "apply_router_weight_on_input", False):
            self._fail("routing weights applied on the input are not served by the QPN MoE kernels")
        self.num_experts, self.hidden, self.inter = int(num_experts), int(hidden_size), int(intermediate_size_per_partition)
        group = self.format.group_size
        if group is not None:
            for dim, what in ((self.hidden, "hidden size"), (self.inter, "intermediate size per rank")):
                if dim % group:
                    self._fail(f"{what} {dim} is not a multiple of the {self.format.title} group size {group}")
        loader = extra_weight_attrs.get("weight_loader")
        layer.num_experts = num_experts
        for name, (shape, dtypes) in self._expected().items():
            if len(shape) == 3:
                param = ModelWeightParameter(data=torch.empty(shape, dtype=dtypes[0]), input_dim=1, output_dim=2,
                                             weight_loader=self._checked_loader(name, loader))
            else:
                # ones: vLLM's compressed-tensors input-scale check compares against an unset 1
                param = PerTensorScaleParameter(data=torch.ones(shape, dtype=dtypes[0]),
                                                weight_loader=self._checked_loader(name, loader))
            kind = self._loader_kind(name)
            if kind is not None:
                param.quant_method = kind
            layer.register_parameter(name, param)

    def _check_complete(self) -> None:
        for name in self._expected():
            shards = ("w2",) if name.startswith("w2_") else ("w1", "w3")
            have = self.loaded.get(name, set())
            if not have and name in self._optional():
                continue
            local = {e for e, _ in have}
            want = len(local) if local else 0
            # every expert that received any tensor of this name must have every shard, and the
            # number of experts must be the layer's local expert count
            for e in sorted(local):
                for s in shards:
                    if (e, s) not in have:
                        self._fail(f"missing tensor: the checkpoint has no {name} ({s}) for expert {e}")
            if want != self.num_experts:
                self._fail(f"missing tensor: {name} was loaded for {want} of the {self.num_experts} experts "
                           "of this rank")

    def _atom(self) -> str:
        """The MMA atom to prepack for: m8n8k4 on CPU (the reference reads any atom) and on
        SM70; the device's native atom where kernels/ops.serving_target admits a newer GPU."""
        if self.backend != "cuda":
            return "m8n8k4"
        from qpn.kernels import ops

        target = ops.serving_target(torch.cuda.get_device_capability())
        return target["atom"] if target else "m8n8k4"

    def process_weights_after_loading(self, layer) -> None:
        from qpn.kernels import moe, prepack

        self._check_complete()
        atom = self._atom()
        n = self._names()

        def data(stem: str, role: str) -> torch.Tensor:
            return getattr(layer, f"{stem}_{n[role]}").data

        try:
            if self.format.output_scale == "global":
                stored13, stored2 = data("w13", "global_scale").float(), data("w2", "global_scale").float()
                if bool((stored13 == 0).any()) or bool((stored2 == 0).any()):
                    self._fail(f"a {n['global_scale']} (global scale) is 0; re-export the checkpoint")
                # per shard: gate and up keep their own (ModelOpt multiplier, compressed-tensors divisor)
                s13, s2 = self.convention.global_scale_f32(stored13), self.convention.global_scale_f32(stored2)
                packed = moe.prepack_moe(self.fmt, data("w13", "codes"), data("w13", "group_scales"), s13,
                                         data("w2", "codes"), data("w2", "group_scales"), s2, atom=atom)
            else:
                packed = moe.prepack_moe(self.fmt, data("w13", "codes"), data("w13", "scale").float(), None,
                                         data("w2", "codes"), data("w2", "scale").float(), atom=atom)
        except prepack.PrepackMismatch as e:
            self._fail(f"prepack inverse is not byte-identical: {e}")
        except (formats.FormatError, moe.MoeShapeError) as e:
            self._fail(f"cannot prepack the experts: {e}")
        for name in list(self._expected()):
            if name in layer._parameters:
                delattr(layer, name)
        self.packed = packed
        _MOE_METHODS.append(self)
        self.op_id = len(_MOE_METHODS) - 1
        self.census_names = [
            CENSUS.register_module(packed.gate, f"{self.prefix}.w13", self.fmt, 2 * self.inter, self.hidden,
                                   eligible=True, prepack_verified=True,
                                   declared=[k for k in self.declared if not k.endswith("down_proj")]),
            CENSUS.register_module(packed.down, f"{self.prefix}.w2", packed.down.fmt, self.hidden, self.inter,
                                   eligible=True, prepack_verified=True,
                                   declared=[k for k in self.declared if k.endswith("down_proj")]),
        ]
        logger.debug("volta-qpn: %s: %d experts prepacked (%s)", self.prefix, self.num_experts, self.fmt)

    # ------------------------------------------------------------------------------ apply
    def apply(self, layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts=None, shared_experts_input=None) -> torch.Tensor:
        if self.packed is None:
            self._fail("apply() before process_weights_after_loading()")
        ids = topk_ids
        expert_map = getattr(layer, "expert_map", None)
        if expert_map is not None:
            ids = expert_map[ids.long()]  # global -> local id, -1 where the expert is not on this rank
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        # One opaque custom op: torch.compile (vLLM's default outside --enforce-eager) cannot
        # trace the census lock, and inside the op the count sees each call's real batch.
        y = _qpn_loader_moe(x2, ids, topk_weights, self.op_id)
        return y.reshape(*lead, y.shape[-1])

    def run(self, x2: torch.Tensor, ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The body of the custom op: compute, count."""
        from qpn.kernels import moe

        y = moe.qpn_moe(x2, ids, topk_weights, self.packed)
        route = moe.moe_route(self.packed)
        graph = _capturing_cuda_graph()
        for name in self.census_names:
            CENSUS.count(name, route, graph=graph)
        return y if y.dtype == x2.dtype else y.to(x2.dtype)


_MOE_METHODS: list[QPNModelOptMoEMethod] = []


@torch.library.custom_op("qpn_loader::moe", mutates_args=())
def _qpn_loader_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    op_id: int) -> torch.Tensor:
    return _MOE_METHODS[op_id].run(x, topk_ids, topk_weights)


@_qpn_loader_moe.register_fake
def _(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, op_id: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], _MOE_METHODS[op_id].hidden))


# -------------------------------------------------------------------- the config side
def declared_moe_algo(quant_config, prefix: str) -> str | None:
    """The quant algo a ModelOpt config declares for the experts at ``prefix`` (None: not a
    ModelOpt config the QPN MoE path serves, or the experts are excluded / unquantized)."""
    from vllm.model_executor.layers.quantization.modelopt import (
        ModelOptFp8Config,
        ModelOptMixedPrecisionConfig,
        ModelOptNvFp4Config,
    )

    if isinstance(quant_config, ModelOptMixedPrecisionConfig):
        if quant_config.is_layer_excluded(prefix):
            return None
        return quant_config._resolve_quant_algo(prefix)
    if isinstance(quant_config, ModelOptNvFp4Config):
        if quant_config.is_layer_excluded(prefix):
            return None
        return str(getattr(quant_config, "quant_method", "NVFP4") or "NVFP4").upper()
    if isinstance(quant_config, ModelOptFp8Config):
        # ModelOpt writes FP8 experts under the same names whether the checkpoint is mixed or FP8
        # only, so a single-format FP8 checkpoint's experts load as the mixed config's FP8 ones
        return None if quant_config.is_layer_excluded(prefix) else "FP8"
    return None


def qpn_moe_method_for(quant_config, moe_config, prefix: str, backend: str):
    """The QPN MoE method for the experts at ``prefix``, None where vLLM's choice stands."""
    algo = declared_moe_algo(quant_config, prefix)
    if algo is None:
        return None
    if algo not in formats.MODELOPT_ALGOS:
        raise QPNCheckpointError(
            f"{prefix}: quantized_layers declares quant_algo {algo!r} for these experts; the QPN MoE "
            f"kernels serve {SERVED_ALGOS} (fix the checkpoint's hf_quant_config.json or serve it on "
            "hardware vLLM supports natively)")
    method = QPNModelOptMoEMethod(moe_config, prefix=prefix, algo=algo, backend=backend)
    if getattr(quant_config, "quantized_layers", None) is not None:
        # the checkpoint's quantized_layers names these experts serve (for the census and its gate)
        candidates = tuple(c + "." for c in quant_config._quantized_layer_prefix_candidates(prefix))
        method.declared = sorted(k for k in quant_config.quantized_layers if k.startswith(candidates))
    else:  # a single-format config quantizes every expert it does not exclude
        method.declared = sorted(f"{prefix}.{e}.{p}" for e in range(int(moe_config.num_experts))
                                 for p in ("gate_proj", "up_proj", "down_proj"))
    return method


# ------------------------------------------------------------ compressed-tensors experts
class QPNCompressedTensorsMoEMethod(QPNModelOptMoEMethod):
    """Routed experts of a compressed-tensors NVFP4 / FP8 MoE layer on the grouped QPN MoE kernels:
    the same method fed through the compressed-tensors convention (``weight_packed``,
    ``weight_scale``, ``weight_global_scale`` inverted per shard; FP8 ``weight_scale`` per tensor
    or per channel). The class name carries no "ModelOpt" on purpose: vLLM's expert
    ``weight_loader`` then takes its generic path, where each parameter's ``quant_method``
    attribute (group / tensor / channel) selects how a per-expert, per-shard tensor lands, the path
    vLLM's own compressed-tensors MoE methods use."""

    def __init__(self, moe_config, prefix: str, algo: str, backend: str, fp8_scale: str = "tensor") -> None:
        super().__init__(moe_config, prefix=prefix, algo=algo, backend=backend, convention=COMPRESSED_TENSORS,
                         fp8_scale=fp8_scale)

    def uses_weight_scale_2_pattern(self) -> bool:
        return False


def ct_declared_expert_scheme(quant_config, layer, layer_name: str):
    """(ModuleScheme, checkpoint names) a compressed-tensors config declares for the experts at
    ``layer_name``, read the way the engines' ``CompressedTensorsMoEMethod.get_moe_method`` reads
    it (the scheme of expert 0's gate, up and down, which must agree); None when the experts are
    ignored, unquantized or INT4. A scheme the QPN MoE path does not serve fails naming the layer."""
    quant_config._add_fused_moe_to_target_scheme_map()
    projs = [getattr(layer, f"ckpt_{p}_proj_name", f"{p}_proj") for p in ("gate", "up", "down")]
    names = [f"{layer_name}.0.{p}" for p in projs]
    dicts = [quant_config.get_scheme_dict(layer, n) for n in names]
    if all(d is None for d in dicts) or is_integer_weights((dicts[0] or {}).get("weights")):
        return None  # unquantized, or INT4 experts: the engine's own MoE method serves them
    if any(d != dicts[0] for d in dicts):
        raise QPNCheckpointError(f"{layer_name}: the experts' gate, up and down declare different schemes "
                                 f"({', '.join(names)}); vLLM fuses them into one layer, so they must agree")
    from qpn.fork_patches.quant.ct_config import served_scheme

    if dicts[0].get("weights") is not None and getattr(quant_config, "transform_config", None):
        raise QPNCheckpointError(f"{layer_name}: the compressed-tensors config carries transforms "
                                 "(transform_config); the QPN MoE path does not apply them")
    scheme = served_scheme(dicts[0], getattr(quant_config, "quant_format", None), layer_name,
                           f"{names[0]}: compressed-tensors config")
    return None if scheme is None else (scheme, names)


def qpn_ct_moe_method_for(quant_config, layer, layer_name: str, backend: str):
    """The QPN MoE method for the routed experts of a compressed-tensors config; None where the
    engine's choice stands (experts ignored or unquantized)."""
    found = ct_declared_expert_scheme(quant_config, layer, layer_name)
    if found is None:
        return None
    scheme, names = found
    algo = formats.FAMILIES[scheme.fmt].algos[0]  # the family's ModelOpt name: NVFP4 | FP8
    method = QPNCompressedTensorsMoEMethod(layer.moe_config, prefix=layer_name, algo=algo, backend=backend,
                                           fp8_scale=scheme.fp8_scale)
    # every expert's gate, up and down (vLLM's names), for the census
    n_experts = int(layer.moe_config.num_experts)  # global count: the checkpoint names every expert
    method.declared = sorted(f"{layer_name}.{e}.{p.rsplit('.', 1)[-1]}" for e in range(n_experts) for p in names)
    return method
