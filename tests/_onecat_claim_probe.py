# Appended to engine_source's import probe (plugin registered against a 1Cat-vLLM source tree
# first on sys.path, QPN_ENGINE=sm70): the registered QPN config in 1Cat's real quantization
# registry, and 1Cat's own ModelConfig._verify_quantization settling each convention's checkpoint
# with and without it. INT4 is claimed only where the family serves; the probe stands in for the
# day formats.INT4 is served (family_ready) and checks QPN_INT4=0 still leaves INT4 to the engine.
# Prints one JSON line QPN_CLAIM_1CAT (tests/test_engine_source.py).
import json
import os
import types

from vllm.config.model import ModelConfig
from vllm.model_executor.layers import quantization as q

from qpn.fork_patches.quant import qpn_config
from qpn.scripts.checkpoints import make_ct_checkpoint, make_int4_checkpoint

CASES = {
    "modelopt-mixed": {"producer": {"name": "modelopt"}, "quant_method": "modelopt",
                       "quantization": {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": "FP8",
                                        "quantized_layers": {"lm_head": {"quant_algo": "NVFP4", "group_size": 16}}}},
    "modelopt-nvfp4": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                       "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]},
    "modelopt-fp8": {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": None,
                     "exclude_modules": ["lm_head"]},
    "ct-nvfp4-fp8": make_ct_checkpoint.quantization_config(),
    "awq": make_int4_checkpoint.quantization_config("awq", 64, False),
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": True, "desc_act": False},
    "ct-int4": make_int4_checkpoint.quantization_config("compressed-tensors", 64, False),
}


def settle(cfg):
    fake = types.SimpleNamespace(quantization=None, hf_config=None, allow_deprecated_quantization=False,
                                 model_arch_config=types.SimpleNamespace(quantization_config=json.loads(json.dumps(cfg))))
    ModelConfig._verify_quantization(fake)
    return fake.quantization


claim = {"registered": q.get_quantization_config("qpn") is qpn_config.config_class(),
         "count": q.QUANTIZATION_METHODS.count("qpn"), "with_qpn": {}, "engine_only": {}, "inner": {},
         "int4_off": {}}
qpn_config.family_ready = lambda fmt: (True, "")
for name, cfg in CASES.items():
    claim["with_qpn"][name] = settle(cfg)
    claim["inner"][name] = type(qpn_config.config_class().from_config(json.loads(json.dumps(cfg)))._inner).__name__
os.environ["QPN_INT4"] = "0"
for name in ("awq", "gptq", "ct-int4"):
    claim["int4_off"][name] = q.get_quantization_config(settle(CASES[name])).__name__
del os.environ["QPN_INT4"]
q.QUANTIZATION_METHODS.remove("qpn")
q._CUSTOMIZED_METHOD_TO_QUANT_CONFIG.pop("qpn")
for name, cfg in CASES.items():
    claim["engine_only"][name] = q.get_quantization_config(settle(cfg)).__name__
print("QPN_CLAIM_1CAT " + json.dumps(claim))
