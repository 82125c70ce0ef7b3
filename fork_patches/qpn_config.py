"""QPN as a registered vLLM quantization method (issue 26 item 3) -- NOT YET WIRED.

``QPNConfig`` is the one config class vLLM's own extension point would hand the QPN checkpoints
to: ``register_quantization_config("qpn")`` adds it to ``QUANTIZATION_METHODS`` (and to the
platform's ``supported_quantization``), and ``ModelConfig._verify_quantization`` probes every
custom method's ``override_quantization_method`` before the built-in overrides (vLLM 0.32 and
1Cat-vLLM 1.2.2 / 1.3.0 alike; ``engine_source.verify_registration`` proves it from each source).

Status: the plugin does NOT call ``register()`` yet; the runtime hooks of hooks.py
(modelopt-mixed-admit-sm70, modelopt-mixed-qpn-linear-methods, modelopt-mixed-qpn-moe-method,
ct-qpn-linear-methods, ct-qpn-moe-method) still choose the QPN methods. The switch (register in
plugin.register, delete those five hooks, census field ``quant_config`` + its gate) is left for a
session that can run the engine e2e tests on it; see docs/hooks.md.

Settled here for the switch (proven against vLLM 0.32 in .venv-cpu and 1Cat-vLLM 1.2.2 / 1.3.0,
whose call sites are the same; tests/test_quant_config.py):

* engine code keyed on the config's name: qwen3_5_mtp.py builds ``mtp.fc`` unquantized only for
  ``get_name() == "modelopt_fp4"``; ``get_name()`` stays "qpn" (the census and a quant_config gate
  key on it) and ``get_quant_method`` takes the same decision (``is_mtp_fc``). config/model.py
  ``is_nvfp4_quantized`` (keyed on ``quantization``) only turns on vLLM's FP4 custom-op fusion
  pass (config/vllm.py), which QPN's methods do not use: left False under "qpn" on purpose.
* ``get_config_filenames``: weight_utils.get_quant_config reads these for a checkpoint without an
  embedded quantization_config; "qpn" reads ``hf_quant_config.json``, ModelOpt's file (the
  compressed-tensors class reads none), so the ModelOpt file form parses through the engine's
  ModelOpt config.

Not settled yet: weight_utils' fall-through to the file for a config.json-embedded mixed config
without ``quantized_layers`` is keyed on ``quantization == "modelopt_mixed"``, so under "qpn" such
a checkpoint reaches ``from_config`` without the per-layer map (needs from_config to read the
file itself, or a hook); the per-rank census record of declared modules that the
ct-qpn-linear-methods hook does.

What the class does once registered:

* ``override_quantization_method(hf_quant_cfg, user_quant)``: "qpn" for a checkpoint QPN serves
  (``claim``) where the QPN path serves (platform_gate.serving_target: CPU reference; SM70 with
  built kernels; sm_80+ only with QPN_SM80_OPT_IN=1), unless the user named another method.
* ``get_min_capability()``: 70.
* ``from_config``: parsing is the engine's own config class for the convention
  (``ModelOptMixedPrecisionConfig``, ``ModelOptNvFp4Config``, ``ModelOptFp8Config``,
  ``CompressedTensorsConfig``; AWQ / GPTQ once the INT4 family serves); QPNConfig wraps it.
* ``get_quant_method(layer, prefix)``: the QPN linear method (linear_method.method_class, chosen by
  quant_config.qpn_method_for / ct_config.qpn_method_for) for quantized linear and lm_head layers,
  the QPN MoE method (moe_method.qpn_moe_method_for / qpn_ct_moe_method_for) for routed experts,
  and the engine config's own method for everything else (unquantized layers, the KV-cache method
  of attention).
"""
from __future__ import annotations

import importlib
import logging
from typing import Any

logger = logging.getLogger("vllm.qpn.qpn_config")

QPN_NAME = "qpn"
MIN_CAPABILITY = 70

# The engine's config class for each convention QPN claims: its registered vLLM name.
ENGINE_NAMES = {
    "modelopt_mixed": "modelopt_mixed",  # ModelOptMixedPrecisionConfig
    "modelopt_fp4": "modelopt_fp4",      # ModelOptNvFp4Config
    "modelopt_fp8": "modelopt",          # ModelOptFp8Config
    "compressed-tensors": "compressed-tensors",
    "awq": "awq",
    "gptq": "gptq",
}


# The files weight_utils.get_quant_config may read for a "qpn" checkpoint without an embedded
# quantization_config (see QPNConfig.get_config_filenames).
CONFIG_FILENAMES = ("hf_quant_config.json",)


def is_mtp_fc(prefix: str) -> bool:
    """The MTP head's fc layer (qwen3_5_mtp.py ``self.fc``: ``mtp.fc``, any model prefix)."""
    return prefix == "mtp.fc" or prefix.endswith(".mtp.fc")


class NotServed(ValueError):
    """A checkpoint of a convention QPN claims, in a form it cannot serve yet (names the fix)."""


# ------------------------------------------------------------------------------ the claim
def _modelopt_algo(cfg: dict) -> str | None:
    inner = cfg.get("quantization") if isinstance(cfg.get("quantization"), dict) else cfg
    algo = inner.get("quant_algo")
    return str(algo).upper() if algo else None


# The ModelOpt quant_algo of a single-format checkpoint -> the key of the engine config that parses it.
MODELOPT_SINGLE = {"NVFP4": "modelopt_fp4", "FP8": "modelopt_fp8"}


def family_ready(fmt) -> tuple[bool, str]:
    """(True, '') when QPN serves ``fmt``'s family end to end: the format is registered as served,
    its family module imports, and the linear methods have a method for it; else why not."""
    if not fmt.served:
        return False, f"qpn.kernels.formats does not serve {fmt.title} yet (served=False)"
    try:
        importlib.import_module(f"qpn.kernels.family_{fmt.family}")
    except ImportError as e:
        return False, f"qpn.kernels.family_{fmt.family} does not import ({e})"
    from qpn.fork_patches.linear_method import METHODS

    if fmt.family not in METHODS:
        return False, f"qpn.fork_patches.linear_method has no {fmt.title} linear method yet"
    return True, ""


def int4_ready() -> tuple[bool, str]:
    """family_ready for the family the AWQ, GPTQ and pack-quantized conventions hand out."""
    from qpn.kernels import formats

    return family_ready(formats.INT4)


def claim(hf_quant_cfg: Any) -> str | None:
    """The convention key (ENGINE_NAMES) of a checkpoint QPN serves, None for one it does not
    claim. Platform-independent; ``override_quantization_method`` adds the platform."""
    if not isinstance(hf_quant_cfg, dict):
        return None
    method = str(hf_quant_cfg.get("quant_method", "")).lower()
    producer = hf_quant_cfg.get("producer")
    if method == "modelopt" or (isinstance(producer, dict) and producer.get("name") == "modelopt"):
        from qpn.kernels import formats

        algo = _modelopt_algo(hf_quant_cfg)
        if algo == "MIXED_PRECISION":
            return "modelopt_mixed"
        return MODELOPT_SINGLE.get(algo) if algo in formats.MODELOPT_ALGOS else None
    if method == "compressed-tensors":
        from qpn.fork_patches.conventions import ConventionError, ct_declared_formats

        try:
            fmts = ct_declared_formats(hf_quant_cfg)
        except ConventionError as e:  # an INT4 pack-quantized group, block FP8, ...
            ok, why = int4_ready() if "neither NVFP4 nor FP8" in str(e) else (True, "")
            if not ok:
                logger.warning("volta-qpn: not claiming this compressed-tensors checkpoint (%s): %s; "
                               "fix: finish the INT4 family (qpn.kernels.family_int4)", e, why)
            return None
        return "compressed-tensors" if fmts else None
    if method in ("awq", "gptq"):
        if int(hf_quant_cfg.get("bits", hf_quant_cfg.get("w_bit", 0)) or 0) != 4:
            return None
        ok, why = int4_ready()
        if not ok:
            logger.warning("volta-qpn: not claiming this %s checkpoint: %s; fix: finish the INT4 family "
                           "(qpn.kernels.family_int4, linear_method int4)", method.upper(), why)
            return None
        return method
    return None


# ------------------------------------------------------------------------------ the config
def _base():
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

    return QuantizationConfig


def make_config_class():
    """QPNConfig, built on the engine's QuantizationConfig (imported here, not at module import)."""
    base = _base()

    class QPNConfig(base):
        """QPN over the engine's own config of the checkpoint's convention (see the module)."""

        def __init__(self, inner, convention: str) -> None:
            super().__init__()  # before _inner: its packed_modules_mapping = {} must not reach inner
            self.__dict__.pop("online_quantization_config", None)  # the inner config's, if any
            object.__setattr__(self, "_inner", inner)
            object.__setattr__(self, "convention", convention)

        # the engine sets and reads these on the config (configure_quant_config, SupportsQuant):
        # they must be the inner config's
        @property
        def packed_modules_mapping(self):
            return self._inner.packed_modules_mapping

        @packed_modules_mapping.setter
        def packed_modules_mapping(self, value):
            if "_inner" in self.__dict__:
                self._inner.packed_modules_mapping = value

        def __getattr__(self, name):  # everything else the engine asks: the inner config's
            inner = self.__dict__.get("_inner")
            if inner is None:
                raise AttributeError(name)
            return getattr(inner, name)

        def apply_vllm_mapper(self, hf_to_vllm_mapper):
            return self._inner.apply_vllm_mapper(hf_to_vllm_mapper)

        def get_name(self) -> str:
            return QPN_NAME

        def get_supported_act_dtypes(self):
            return self._inner.get_supported_act_dtypes()

        @classmethod
        def get_min_capability(cls) -> int:
            return MIN_CAPABILITY

        @staticmethod
        def get_config_filenames() -> list[str]:
            # weight_utils.get_quant_config reads these only when config.json carries no
            # quantization_config: the ModelOpt file form (hf_quant_config.json, the one name
            # ModelOptQuantConfigBase.get_config_filenames gives in vLLM 0.32 and both 1Cat
            # releases). compressed-tensors' class gives [] (its config is always in config.json),
            # so the union over the conventions QPN claims is the ModelOpt file.
            return list(CONFIG_FILENAMES)

        @classmethod
        def from_config(cls, config: dict[str, Any]):
            convention = claim(config)
            if convention is None:
                raise NotServed(f"qpn: the checkpoint's quantization config (quant_method "
                                f"{config.get('quant_method')!r}) is not one QPN serves")
            from vllm.model_executor.layers.quantization import get_quantization_config

            engine_cls = get_quantization_config(ENGINE_NAMES[convention])
            return cls(engine_cls.from_config(config), convention)

        @classmethod
        def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
            if user_quant not in (None, QPN_NAME):
                return None  # the user named a method: theirs
            from qpn.fork_patches.platform_gate import serving_target

            if serving_target() is None or claim(hf_quant_cfg) is None:
                return None
            return QPN_NAME

        def get_quant_method(self, layer, prefix: str):
            if self.convention == "modelopt_fp4" and is_mtp_fc(prefix):
                # vLLM 0.32 qwen3_5_mtp.py (and 1Cat's) builds mtp.fc unquantized only when
                # quant_config.get_name() == "modelopt_fp4": the layer is BF16 in NVFP4 checkpoints
                # but missing from exclude_modules. get_name() stays "qpn" (the census and the
                # quant_config gate key on it), so the same decision is taken here, no hook needed.
                from vllm.model_executor.layers.linear import UnquantizedLinearMethod

                return UnquantizedLinearMethod()
            method = qpn_method(self._inner, self.convention, layer, prefix)
            return method if method is not None else self._inner.get_quant_method(layer, prefix)

    return QPNConfig


def qpn_method(inner, convention: str, layer, prefix: str):
    """The QPN method for ``layer`` under the engine config ``inner``; None: the engine's."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    from qpn.fork_patches.platform_gate import serving_target

    target = serving_target()
    if target is None:
        return None
    if isinstance(layer, RoutedExperts):
        from qpn.fork_patches import moe_method

        if convention.startswith("modelopt"):
            return moe_method.qpn_moe_method_for(inner, layer.moe_config, prefix, target["backend"])
        if convention == "compressed-tensors":
            return moe_method.qpn_ct_moe_method_for(inner, layer, prefix, target["backend"])
        return None
    if not isinstance(layer, (LinearBase, ParallelLMHead)):
        return None
    if convention == "modelopt_mixed":
        from qpn.fork_patches import quant_config

        if inner.is_layer_excluded(prefix):
            return None
        return quant_config.qpn_method_for(inner, layer, prefix, target)
    if convention in MODELOPT_SINGLE.values():
        from qpn.fork_patches.linear_method import method_class
        from qpn.kernels import formats

        if inner.is_layer_excluded(prefix):
            return None
        algo = next(a for a, c in MODELOPT_SINGLE.items() if c == convention)
        proj = prefix.rsplit(".", 1)[-1]
        return method_class(formats.MODELOPT_ALGOS[algo])(
            prefix=prefix, algo=algo, backend=target["backend"], arch=target["arch"], atom=target["atom"],
            shard_names=list((inner.packed_modules_mapping or {}).get(proj, [])), declared=[prefix])
    if convention == "compressed-tensors":
        from qpn.fork_patches import ct_config

        return ct_config.qpn_method_for(inner, layer, prefix, target)
    raise NotServed(f"{prefix}: qpn claimed a {convention} checkpoint but its INT4 linear method is not "
                    "wired yet (qpn.fork_patches.qpn_config.qpn_method); fix: finish the INT4 family")


_CLASS = None


def config_class():
    global _CLASS
    if _CLASS is None:
        _CLASS = make_config_class()
    return _CLASS


def register():
    """Register QPNConfig under "qpn" with the engine (idempotent). NOT called by the plugin yet."""
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, register_quantization_config

    cls = config_class()
    if QPN_NAME not in QUANTIZATION_METHODS:
        register_quantization_config(QPN_NAME)(cls)
    return cls
