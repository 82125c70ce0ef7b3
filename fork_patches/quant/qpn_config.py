"""QPN as a registered vLLM quantization method: the one way the QPN methods reach the engine.

``QPNConfig`` is registered under the name "qpn" through vLLM's own extension point,
``register_quantization_config`` (``register()``, called by ``plugin.register`` in every vLLM
process: API server, engine core, workers). That adds "qpn" to ``QUANTIZATION_METHODS`` and to the
platform's ``supported_quantization``, and ``ModelConfig._verify_quantization`` then probes its
``override_quantization_method`` before the built-in overrides (modelopt, modelopt_fp4,
modelopt_mixed, awq, gptq, ...), in vLLM 0.32 and 1Cat-vLLM 1.2.2 / 1.3.0 alike
(``engine_source.verify_registration`` proves it from each engine's source, and
tests/test_quant_config.py and tests/test_engine_source.py on each engine's real modules).

What it claims (``claim_verdict``): ModelOpt MIXED_PRECISION / NVFP4 / FP8, compressed-tensors
NVFP4 / FP8, and AWQ, GPTQ and compressed-tensors pack-quantized integer weights (W4A16, W8A16)
when their integer family serves (``family_served``: the family's members served, and the family's
environment switch, ``QPN_INT4`` / ``QPN_INT8``, is not 0; at 0 the engine's own kernels serve
those checkpoints). It claims only where
the QPN path serves (``platform_gate.serving_target``: the CPU reference on the cpu engine; SM70
with built kernels; sm_80+ only with QPN_SM80_OPT_IN=1) and never when the user named another
method; a checkpoint of these conventions in a form QPN does not serve (another ModelOpt algo,
block FP8, integers with group 16, ...) is left to the engine, with a warning that says why.

What the class does once it claimed a checkpoint:

* ``get_min_capability()``: 70.
* ``from_config``: the engine's own config class for the convention (``ENGINE_NAMES``) parses the
  checkpoint's config; QPNConfig wraps it and answers with it everything the engine asks a
  config (``packed_modules_mapping``, ``apply_vllm_mapper``, ``maybe_update_config``, the weight
  and KV-scale mappers, any other attribute).
* ``get_quant_method(layer, prefix)``: the QPN linear method for each quantized linear and
  lm_head layer (``quant_config.qpn_method_for``, ``ct_config.qpn_method_for``,
  ``linear_method.qpn_linear_method``); the QPN MoE method for routed experts
  (``moe_method.qpn_moe_method_for`` / ``qpn_ct_moe_method_for``), which both engines ask the
  config for (vLLM 0.32: ``RoutedExperts._get_quant_method`` -> ``resolve_quant_method`` ->
  ``get_quant_method``; 1Cat: the closure in ``FusedMoE.__init__``, where ``RoutedExperts`` is
  an alias of ``FusedMoE``); the engine config's own method for everything else (unquantized
  layers, INT4 experts, which QPN has no MoE kernels for, the KV-cache method of attention).
* Its first call on a rank records what the boot gates read (``record_rank``): the config's
  name (census ``quant_config``; the ``quant_config`` gate fails a boot whose checkpoint QPN
  should serve and whose ranks did not record "qpn"), the KV cache, the engine config, the
  engine's renamed ``quantized_layers`` (ModelOpt mixed), and the checkpoint's declared modules
  with the engine's names for them (every convention but ModelOpt: compressed-tensors, AWQ,
  GPTQ; ``record_checkpoint_modules``).

Engine behaviour keyed on the config's name, settled here:

* qwen3_5_mtp.py builds ``mtp.fc`` unquantized only for ``get_name() == "modelopt_fp4"`` (the
  layer is BF16 in NVFP4 checkpoints but missing from exclude_modules). ``get_name()`` stays "qpn"
  (the census and the quant_config gate key on it), so ``get_quant_method`` takes the same
  decision (``is_mtp_fc``).
* config/model.py ``is_nvfp4_quantized`` (keyed on ``quantization``) only turns on vLLM's FP4
  custom-op fusion pass (config/vllm.py), which QPN's methods do not use: False under "qpn" on
  purpose.
* weight_utils.get_quant_config reads ``hf_quant_config.json`` for a config.json-embedded mixed
  config without ``quantized_layers`` only under the name "modelopt_mixed". Under "qpn",
  ``from_config`` keeps such a config pending and ``maybe_update_config``, which the engine calls
  right after it with the model folder (``VllmConfig._get_quantization_config`` in all three
  engines), reads the folder's ``hf_quant_config.json``.
* ``get_config_filenames``: weight_utils.get_quant_config reads these for a checkpoint without an
  embedded quantization_config: ``hf_quant_config.json``, ModelOpt's file, so the ModelOpt file
  form parses through the engine's ModelOpt config. compressed-tensors keeps its config in
  config.json; AWQ and GPTQ are claimed from config.json's quantization_config (the form their
  exporters write today, and the one the launcher's INT4 checks read), not from AutoGPTQ's older
  quantize_config.json, which vLLM only reads when asked for --quantization gptq.
* Every engine's GPTQ config refuses ``sym: false`` (its kernels have no zero points), which the QPN method
  serves; QPNConfig has the engine parse the symmetric twin of such a config (the engine's config
  only names modules and answers the engine; the QPN method reads the zero points from the checkpoint's own
  config), and refuses asymmetric GPTQ experts, which no method would then serve correctly.
* vLLM 0.32 drops every ``.g_idx`` tensor from the weights it loads
  (``QuantizationConfig.get_checkpoint_weight_mapper``: its kernels refuse act order). The QPN method reads
  GPTQ's g_idx (a map that moves whole groups is served; one that mixes groups is refused naming
  the module), so for GPTQ the mapper keeps it.
"""
from __future__ import annotations

import importlib
import json
import logging
import os
from typing import Any

logger = logging.getLogger("vllm.qpn.qpn_config")

QPN_NAME = "qpn"
MIN_CAPABILITY = 70
SWITCH_PREFIX = "QPN_"  # QPN_<FAMILY>=0: the engine's own kernels serve that family's checkpoints (default 1)

# The engine's config class for each convention QPN claims: its registered vLLM name.
ENGINE_NAMES = {
    "modelopt_mixed": "modelopt_mixed",  # ModelOptMixedPrecisionConfig
    "modelopt_fp4": "modelopt_fp4",      # ModelOptNvFp4Config
    "modelopt_fp8": "modelopt",          # ModelOptFp8Config
    "compressed-tensors": "compressed-tensors",
    "awq": "awq",
    "gptq": "gptq",
}
INTEGER_METHODS = ("awq", "gptq")  # conventions whose every quantized module is of an integer family

# The files weight_utils.get_quant_config may read for a "qpn" checkpoint without an embedded
# quantization_config (see QPNConfig.get_config_filenames).
CONFIG_FILENAMES = ("hf_quant_config.json",)
MODELOPT_FILE = CONFIG_FILENAMES[0]


def is_mtp_fc(prefix: str) -> bool:
    """The MTP head's fc layer (qwen3_5_mtp.py ``self.fc``: ``mtp.fc``, any model prefix)."""
    return prefix == "mtp.fc" or prefix.endswith(".mtp.fc")


class NotServed(ValueError):
    """A checkpoint or setting QPN cannot serve as asked (names the problem and the fix)."""


# ------------------------------------------------------------------------------ family readiness
def family_switch(fmt, environ=None) -> bool:
    """``QPN_<FAMILY>`` (``QPN_INT4``, ``QPN_INT8``): 1 (or unset) lets QPN serve the family's
    checkpoints, 0 leaves them to the engine's own kernels."""
    var = SWITCH_PREFIX + fmt.family.upper()
    raw = (os.environ if environ is None else environ).get(var, "1")
    value = str(raw).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise NotServed(f"{var}={raw!r} is not a switch value; set {var}=1 (QPN serves {fmt.title} checkpoints, "
                    f"the default) or {var}=0 (the engine's own kernels serve them)")


def family_ready(fmt) -> tuple[bool, str]:
    """(True, '') when QPN serves ``fmt``'s family end to end: the format is registered as served,
    its family package's numerics import, and it has the loader schema the linear method reads
    (kernels/families/<family>/loader.py); else why not."""
    if not fmt.served:
        return False, f"qpn.kernels.formats does not serve {fmt.title} yet (served=False)"
    try:
        importlib.import_module(f"qpn.kernels.families.{fmt.family}.numerics")
    except ImportError as e:
        return False, f"qpn.kernels.families.{fmt.family}.numerics does not import ({e})"
    from qpn.kernels import families

    try:
        families.loader_of(fmt.family)
    except (ImportError, families.ContractError) as e:
        return False, f"qpn.kernels.families.{fmt.family} has no loader schema for the linear method yet ({e})"
    return True, ""


def family_served(fmt, environ=None) -> tuple[bool, str]:
    """(True, '') when QPN claims checkpoints of ``fmt``'s family: it is ready and its switch is on."""
    if not family_switch(fmt, environ):
        return False, (f"{SWITCH_PREFIX}{fmt.family.upper()}=0 leaves {fmt.title} checkpoints to the engine's "
                       "own kernels")
    return family_ready(fmt)


# ------------------------------------------------------------------------------ the claim
def _modelopt_algo(cfg: dict) -> str | None:
    inner = cfg.get("quantization") if isinstance(cfg.get("quantization"), dict) else cfg
    algo = inner.get("quant_algo")
    return str(algo).upper() if algo else None


# The ModelOpt quant_algo of a single-format checkpoint -> the key of the engine config that parses it.
MODELOPT_SINGLE = {"NVFP4": "modelopt_fp4", "FP8": "modelopt_fp8"}


def claim_verdict(hf_quant_cfg: Any, environ=None) -> tuple[str | None, str]:
    """(convention key of ENGINE_NAMES, '') for a checkpoint QPN serves; (None, why) for one of a
    convention QPN claims in a form it does not serve; (None, '') for any other checkpoint.
    Platform-independent (``override_quantization_method`` adds the platform); ``environ`` is
    where the families' switches (``QPN_INT4``, ...) are read (default os.environ)."""
    if not isinstance(hf_quant_cfg, dict):
        return None, ""
    method = str(hf_quant_cfg.get("quant_method", "")).lower()
    producer = hf_quant_cfg.get("producer")
    if method == "modelopt" or (isinstance(producer, dict) and producer.get("name") == "modelopt"):
        from qpn.kernels import formats

        algo = _modelopt_algo(hf_quant_cfg)
        if algo == "MIXED_PRECISION":
            return "modelopt_mixed", ""
        if algo in formats.MODELOPT_ALGOS and algo in MODELOPT_SINGLE:
            return MODELOPT_SINGLE[algo], ""
        return None, (f"ModelOpt quant_algo {algo!r}: QPN serves MIXED_PRECISION, "
                      f"{', '.join(MODELOPT_SINGLE)}")
    from qpn.fork_patches.quant import conventions

    integer = conventions.integer_convention_of(hf_quant_cfg)
    if integer is not None:
        try:
            schemes = (list(conventions.integer_group_schemes(hf_quant_cfg).values())
                       if integer.declared_by == "config_groups" else [integer.scheme(hf_quant_cfg)])
        except conventions.ConventionError as e:
            return None, str(e)
        for fmt in dict.fromkeys(s.format for s in schemes):
            ok, why = family_served(fmt, environ)
            if not ok:
                return None, why
        return method, ""
    if method == "compressed-tensors":
        try:
            fmts = conventions.ct_declared_formats(hf_quant_cfg)
        except conventions.ConventionError as e:  # block FP8, MXFP4, ...
            return None, str(e)
        return ("compressed-tensors", "") if fmts else (None, "no config group quantizes weights")
    return None, ""


def claim(hf_quant_cfg: Any, environ=None) -> str | None:
    """The convention key (ENGINE_NAMES) of a checkpoint QPN serves, None otherwise."""
    return claim_verdict(hf_quant_cfg, environ)[0]


def _has_quantized_layers(cfg: dict) -> bool:
    nested = cfg.get("quantization") if isinstance(cfg.get("quantization"), dict) else {}
    return bool(cfg.get("quantized_layers") or nested.get("quantized_layers"))


def mixed_config_from_folder(model: str) -> dict:
    """The ModelOpt file (``hf_quant_config.json``) of a local checkpoint folder, for a config.json
    that embeds MIXED_PRECISION without its ``quantized_layers`` map; NotServed names the fix."""
    what = (f"config.json of {model!r} declares ModelOpt MIXED_PRECISION without its quantized_layers "
            f"map, which ModelOpt keeps in {MODELOPT_FILE}")
    if not os.path.isdir(model):
        raise NotServed(f"{what}, and the model is not a local folder QPN can read it from; fix: download "
                        "the checkpoint to a folder (hf download ... --local-dir DIR) and serve DIR")
    path = os.path.join(model, MODELOPT_FILE)
    if not os.path.isfile(path):
        raise NotServed(f"{what}, and {path} does not exist; fix: put ModelOpt's {MODELOPT_FILE} back "
                        "beside config.json (its exporter writes both)")
    with open(path) as f:
        cfg = json.load(f)
    if claim(cfg) != "modelopt_mixed" or not _has_quantized_layers(cfg):
        raise NotServed(f"{what}, and {path} holds no MIXED_PRECISION quantized_layers map either; fix: "
                        "re-export the checkpoint with ModelOpt")
    return cfg


# ------------------------------------------------------------------------------ the config
def _base():
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

    return QuantizationConfig


def make_config_class():
    """QPNConfig, built on the engine's QuantizationConfig (imported here, not at module import:
    the launcher reads this module's claim without an engine)."""
    base = _base()

    class QPNConfig(base):
        """QPN over the engine's own config of the checkpoint's convention (see the module)."""

        def __init__(self, inner, convention: str, raw: dict | None = None, engine_cls=None) -> None:
            super().__init__()  # before _inner: its packed_modules_mapping = {} must not reach inner
            self.__dict__.pop("online_quantization_config", None)  # the inner config's, if any
            self._inner = inner  # None: a mixed config maybe_update_config completes
            self.convention = convention
            self.raw = dict(raw or {})  # the checkpoint's quantization config
            self.engine_cls = engine_cls or type(inner)

        # the engine sets and reads these on the config (configure_quant_config, SupportsQuant):
        # they must be the inner config's
        @property
        def packed_modules_mapping(self):
            return self._inner.packed_modules_mapping

        @packed_modules_mapping.setter
        def packed_modules_mapping(self, value):
            if self.__dict__.get("_inner") is not None:
                self._inner.packed_modules_mapping = value

        @property
        def _ignore_unexpected_suffixes(self):
            return self._inner._ignore_unexpected_suffixes

        def __getattr__(self, name):  # everything else the engine asks: the inner config's
            inner = self.__dict__.get("_inner")
            if inner is None:
                raise AttributeError(name)
            return getattr(inner, name)

        def apply_vllm_mapper(self, hf_to_vllm_mapper):
            return self._inner.apply_vllm_mapper(hf_to_vllm_mapper)

        def maybe_update_config(self, model_name, *args, **kwargs):
            if self._inner is None:
                self._inner = self.engine_cls.from_config(mixed_config_from_folder(model_name))
            # AWQ / GPTQ read which modules are unquantized from the safetensors metadata here
            return self._inner.maybe_update_config(model_name, *args, **kwargs)

        def get_cache_scale_mapper(self):
            return self._inner.get_cache_scale_mapper()

        def get_checkpoint_weight_mapper(self):
            if self.convention == "gptq":
                from vllm.model_executor.models.utils import WeightsMapper

                return WeightsMapper()  # keep g_idx: the QPN method reads it (see the module)
            return self._inner.get_checkpoint_weight_mapper()

        def get_name(self) -> str:
            return QPN_NAME

        def get_supported_act_dtypes(self):
            if self._inner is None:  # the engine asks before maybe_update_config; the answer is the class's
                return self.engine_cls.get_supported_act_dtypes(self)
            return self._inner.get_supported_act_dtypes()

        @classmethod
        def get_min_capability(cls) -> int:
            return MIN_CAPABILITY

        @staticmethod
        def get_config_filenames() -> list[str]:
            return list(CONFIG_FILENAMES)

        @classmethod
        def from_config(cls, config: dict[str, Any]):
            convention, why = claim_verdict(config)
            if convention is None:
                raise NotServed(f"qpn: the checkpoint's quantization config (quant_method "
                                f"{config.get('quant_method')!r}) is not one QPN serves"
                                + (f": {why}" if why else "") + "; fix: serve it without --quantization qpn")
            from vllm.model_executor.layers.quantization import get_quantization_config

            engine_cls = get_quantization_config(ENGINE_NAMES[convention])
            if convention == "modelopt_mixed" and not _has_quantized_layers(config):
                return cls(None, convention, config, engine_cls)
            parsed = config
            if convention == "gptq" and config.get("sym") is False:
                # every engine's GPTQ config refuses sym false (it has no kernel for zero points);
                # the QPN method reads the zero points itself (from config.raw), and the engine's config only
                # names the modules, so it parses the symmetric twin (see qpn_method for experts)
                parsed = {**config, "sym": True}
            return cls(engine_cls.from_config(parsed), convention, config, engine_cls)

        @classmethod
        def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
            if user_quant not in (None, QPN_NAME):
                return None  # the user named a method: theirs
            from qpn.fork_patches.engine.platform_gate import serving_target

            asked = user_quant == QPN_NAME
            if serving_target() is None:
                if asked:
                    raise NotServed("--quantization qpn: the QPN path does not serve on this device (see the "
                                    "platform gate's warning above); fix: serve on a V100 with built kernels, "
                                    "the cpu engine, or sm_80+ with QPN_SM80_OPT_IN=1")
                return None
            convention, why = claim_verdict(hf_quant_cfg)
            if convention is None:
                if asked:
                    why = why or "not a ModelOpt, compressed-tensors, AWQ or GPTQ checkpoint"
                    raise NotServed(f"--quantization qpn: QPN does not serve this checkpoint ({why}); fix: "
                                    "leave --quantization out")
                if why:
                    logger.warning("volta-qpn: not claiming this %s checkpoint (%s); the engine's own "
                                   "quantization method serves it", hf_quant_cfg.get("quant_method"), why)
                return None
            return QPN_NAME

        def get_quant_method(self, layer, prefix: str):
            from qpn.fork_patches.engine.platform_gate import serving_target

            target = serving_target()
            if target is None:
                raise NotServed(f"{prefix}: the QPN config claimed this checkpoint, but the QPN path does not "
                                "serve in this process (platform_gate.serving_target is None: see its warning); "
                                "fix: build the QPN kernels for this GPU (scripts/bootstrap-sm70.sh)")
            record_rank(self)
            if self.convention == "modelopt_fp4" and is_mtp_fc(prefix):
                # the engine's own workaround, keyed on the name "modelopt_fp4" (see the module)
                from vllm.model_executor.layers.linear import UnquantizedLinearMethod

                return UnquantizedLinearMethod()
            method = qpn_method(self, layer, prefix, target)
            return method if method is not None else self._inner.get_quant_method(layer, prefix)

    QPNConfig.__module__ = __name__
    QPNConfig.__qualname__ = "QPNConfig"
    return QPNConfig


def qpn_method(config, layer, prefix: str, target: dict):
    """The QPN method for ``layer`` under the QPN config ``config``; None: the engine config's."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    inner, convention = config._inner, config.convention
    if isinstance(layer, RoutedExperts):
        from qpn.fork_patches.quant import moe_method

        if convention.startswith("modelopt"):
            return moe_method.qpn_moe_method_for(inner, layer.moe_config, prefix, target["backend"])
        if convention == "compressed-tensors":
            return moe_method.qpn_ct_moe_method_for(inner, layer, prefix, target["backend"])
        if convention == "gptq" and config.raw.get("sym") is False:
            raise NotServed(f"{prefix}: asymmetric GPTQ experts (sym false): QPN has no integer MoE kernels and "
                            "the engine's GPTQ MoE methods have none for zero points; fix: serve a symmetric "
                            "GPTQ or an AWQ / compressed-tensors export of the model")
        return None  # AWQ / GPTQ experts: QPN has no integer MoE kernels, the engine's method serves them
    if not isinstance(layer, (LinearBase, ParallelLMHead)):
        return None
    if convention == "modelopt_mixed":
        from qpn.fork_patches.quant import quant_config

        if inner.is_layer_excluded(prefix):
            return None
        return quant_config.qpn_method_for(inner, layer, prefix, target)
    if convention in MODELOPT_SINGLE.values():
        from qpn.fork_patches.quant.linear_method import qpn_linear_method

        if inner.is_layer_excluded(prefix):
            return None
        algo = next(a for a, c in MODELOPT_SINGLE.items() if c == convention)
        proj = prefix.rsplit(".", 1)[-1]
        return qpn_linear_method(prefix, algo, target, shard_names=list((inner.packed_modules_mapping or {}).get(proj, [])),
                                 declared=[prefix])
    if convention == "compressed-tensors":
        from qpn.fork_patches.quant import ct_config

        return ct_config.qpn_method_for(inner, layer, prefix, target)
    if convention in INTEGER_METHODS:
        return integer_linear_method(config, layer, prefix, target)
    raise NotServed(f"{prefix}: qpn claimed a checkpoint of convention {convention!r}, which it has no "
                    "method for (qpn.fork_patches.quant.qpn_config.qpn_method)")


def integer_linear_method(config, layer, prefix: str, target: dict):
    """The QPN method of an AWQ / GPTQ linear layer; UnquantizedLinearMethod where the config
    leaves it unquantized, None for an lm_head the config does not quantize (the engine's). Which
    modules are unquantized: the engine config's own lists (renamed to the engine's names, and
    read from the safetensors metadata by its maybe_update_config where the config has none),
    by the engines' rules (conventions.Convention.excluded); every shard of a fused module
    must agree."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    from qpn.fork_patches.quant.conventions import CONVENTIONS
    from qpn.fork_patches.quant.linear_method import QPNCheckpointError, qpn_linear_method

    inner, conv = config._inner, CONVENTIONS[config.convention]
    if isinstance(layer, ParallelLMHead) and not getattr(inner, "lm_head_quantized", False):
        return None
    proj = prefix.rsplit(".", 1)[-1]
    shard_names = list((inner.packed_modules_mapping or {}).get(proj, []))
    base = prefix.rsplit(".", 1)[0]
    names = [f"{base}.{s}" for s in shard_names] if shard_names else [prefix]
    lists = dict(not_convert=getattr(inner, "modules_to_not_convert", None) or (),
                 dynamic=getattr(inner, "dynamic", None) or {},
                 only=_flat(getattr(inner, "modules_in_block_to_quantize", None) or ()))
    excluded = {n: conv.excluded(n, **lists) for n in names}
    if len(set(excluded.values())) != 1:
        raise QPNCheckpointError(f"{prefix}: the {conv.name} config leaves {sorted(n for n, e in excluded.items() if e)} "
                                 f"unquantized but quantizes {sorted(n for n, e in excluded.items() if not e)}; vLLM "
                                 "fuses them into one layer, so they must agree")
    if all(excluded.values()):
        return UnquantizedLinearMethod()
    scheme = conv.scheme(config.raw)
    return qpn_linear_method(prefix, scheme, target, conv, shard_names=shard_names, declared=names)


def _flat(items) -> list[str]:
    """GPTQ's modules_in_block_to_quantize, flat (it may be a list of lists)."""
    out = []
    for item in items:
        out.extend(_flat(item) if isinstance(item, (list, tuple)) else [item])
    return out


# ------------------------------------------------------------------------------ the census
RANK_RECORDED = False


def record_rank(config) -> None:
    """Once per rank, at the first layer the engine asks the config about (the engine's config is
    current then): what the boot gates read besides the modules (see the module)."""
    global RANK_RECORDED
    if RANK_RECORDED:
        return
    from vllm.config import get_current_vllm_config_or_none

    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is None or vllm_config.cache_config is None:
        return
    RANK_RECORDED = True
    from qpn.fork_patches.route_census.census import CENSUS
    from qpn.fork_patches.engine.kv_policy import describe

    CENSUS.set_quant_config(config.get_name())
    CENSUS.set_kv_cache(*describe(vllm_config))
    CENSUS.watch_engine(vllm_config)
    if getattr(config._inner, "quantized_layers", None) is not None:
        CENSUS.set_quantized_layers(config._inner.quantized_layers)  # renamed by the model's mapper
    # ModelOpt's declared modules pair by position with the engine's quantized_layers (above);
    # every other convention's (compressed-tensors, AWQ, GPTQ) by name, through this record
    if not config.convention.startswith("modelopt"):
        try:
            record_checkpoint_modules(vllm_config)
        except (ImportError, AttributeError, OSError, ValueError) as e:  # the gate fails on the gap
            logger.error("volta-qpn: could not record the checkpoint's module names for the census "
                         "(%s: %s); the qpn_routes gate will fail this boot", type(e).__name__, e)


def engine_module_names(model_class, names: list[str]) -> dict[str, str | None]:
    """{checkpoint module name: the engine's name for it} by the model class's hf_to_vllm_mapper,
    applied the way the engine applies it to a quant config's module names (vLLM 0.32: its
    rename-only variant ``get_rename_mapper``; 1Cat-vLLM 1.2.2 / 1.3.0, which have none: the
    mapper itself; ``_map_name`` in all three). None: the mapper drops the module."""
    mapper = getattr(model_class, "hf_to_vllm_mapper", None)
    if mapper is None:
        return {n: n for n in names}
    if hasattr(mapper, "get_rename_mapper"):
        mapper = mapper.get_rename_mapper()
    return {n: mapper._map_name(n) for n in names}


def record_checkpoint_modules(vllm_config) -> dict[str, str | None] | None:
    """Put in the census every module the served folder's checkpoint declares quantized, with the
    engine's name for it, so that the qpn_routes gate can require each one on a QPN route (the
    census's per-module ``declared`` lists carry engine names). The modules are those the
    launcher reads (boot_gates.declared_modules, ``conventions.declared_modules``: AWQ's and GPTQ's
    modules holding codes less the config's skips, compressed-tensors' config_groups targets less
    ignore). The engine's config does
    not keep the mapper it renamed its names with; the model class it builds does, whatever the
    quantization, and the engine loads each checkpoint tensor under the name that mapper gives it
    (a quant config's own mappers touch scale and g_idx suffixes only; tests/test_quant_config.py
    proves both from each engine's source)."""
    from qpn.fork_patches.quant import conventions
    from qpn.fork_patches.route_census.census import CENSUS

    model_config = getattr(vllm_config, "model_config", None)
    path = getattr(model_config, "model", None)
    if not path or not os.path.isdir(path):
        logger.warning("volta-qpn: the served model %r is not a local folder; the census gets no "
                       "checkpoint module names and the qpn_routes gate reports that", path)
        return None
    from vllm.model_executor.model_loader.utils import get_model_architecture

    _, declared = conventions.declared_modules(path)
    model_class, _ = get_model_architecture(model_config)
    names = engine_module_names(model_class, list(declared))
    CENSUS.set_checkpoint_modules(names)
    return names


# ------------------------------------------------------------------------------ registration
_CLASS = None


def config_class():
    global _CLASS
    if _CLASS is None:
        _CLASS = make_config_class()
    return _CLASS


def __getattr__(name: str):
    # The class is built on first use (it needs the engine); pickle finds it here by name when a
    # VllmConfig holding a QPNConfig crosses into an engine process.
    if name == "QPNConfig":
        return config_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register():
    """Register QPNConfig under "qpn" with the engine; a second call changes nothing."""
    from vllm.model_executor.layers import quantization as q

    cls = config_class()
    if QPN_NAME not in q.QUANTIZATION_METHODS or q.get_quantization_config(QPN_NAME) is not cls:
        q.register_quantization_config(QPN_NAME)(cls)
    return cls
