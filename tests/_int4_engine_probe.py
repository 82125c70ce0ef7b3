"""Run as a script on the cpu engine's interpreter (tests/test_e2e_int4.py): vLLM 0.32 in this one
process (VLLM_ENABLE_V1_MULTIPROCESSING=0: no engine-core process to start) loads an INT4 checkpoint
through its own model loader, with the overlay's plugin as installed, and reports the quantization
config it built and the teacher-forced prompt log-probabilities of a chat prompt (and one decoded
token). Prints one JSON line QPN_INT4_ENGINE.

    python tests/_int4_engine_probe.py CKPT PROMPT_TEXT
"""
import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from vllm import LLM, SamplingParams  # noqa: E402

ckpt, prompt = sys.argv[1], sys.argv[2]
llm = LLM(model=ckpt, enforce_eager=True, max_model_len=512, dtype="bfloat16", gpu_memory_utilization=0.3)
ids = llm.get_tokenizer().encode(prompt, add_special_tokens=False)
result = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=2, prompt_logprobs=1, temperature=0))
logprobs = result[0].prompt_logprobs
chosen = [logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
top1 = [next(t for t, lp in logprobs[i].items() if lp.rank == 1) for i in range(1, len(ids))]
quant = llm.llm_engine.vllm_config.quant_config
print("QPN_INT4_ENGINE " + json.dumps({"quant_config": quant.get_name(), "ids": ids, "logprobs": chosen,
                                       "top1": top1}), flush=True)
