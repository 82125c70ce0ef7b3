# Appended to engine_source's import probe (plugin registered against a 1Cat-vLLM source tree
# first on sys.path, QPN_ENGINE=sm70): K=auto's hooks on 1Cat's real classes, with stand-ins only
# for what a CPU process cannot build (models, attention metadata, the forward context). Prints
# one JSON line QPN_DEPTH_1CAT (tests/test_auto_depth_1cat.py).
import contextlib
import json
import os
import pickle
import types

import numpy as np
import torch

os.environ.update({"QPN_DEPTH_LADDER": "3,7", "QPN_DEPTH_CONSTANTS": json.dumps({"b_ms_per_token": 0.02}),
                   "QPN_DEPTH_PRIOR_ROUNDS": "1e12", "QPN_DEPTH_VERIFY": "deepest"})

import vllm.v1.spec_decode.llm_base_proposer as lbp  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.spec_decode.eagle import EagleProposer  # noqa: E402

from qpn.fork_patches.spec import auto_depth  # noqa: E402

res = {"chains": {}}
for label, obj in (("propose", lbp.SpecDecodeBaseProposer.propose),
                   ("update_after_schedule", Scheduler._update_after_schedule),
                   ("update_from_output", Scheduler.update_from_output),
                   ("make_spec_decoding_stats", Scheduler.make_spec_decoding_stats)):
    res["chains"][label] = plugin.hooks_on_chain(obj)  # noqa: F821 (the import probe's)

# ---- the drafter: 1Cat's own propose, its loop reading num_speculative_tokens ------------------
N, K, H = 3, 7, 8
lbp.set_forward_context = lambda *a, **k: contextlib.nullcontext()  # no vLLM config on CPU
lbp._clone_drafter_mutable_metadata = lambda cad: cad
forwards = []


class Model:
    def __call__(self, spec_step_idx=None, input_ids=None, **kwargs):
        forwards.append(spec_step_idx)
        return torch.zeros(input_ids.shape[0], H)


def sample(hidden, sampling_metadata, logits=None, spec_step_idx=0):
    # position j of request i drafts token 100 (j + 1) + i
    return torch.arange(hidden.shape[0]) + 100 * (spec_step_idx + 1), None


p = object.__new__(EagleProposer)
state = dict(
    method="mtp", _static_draft_vocab=None, _last_draft_probs=None, parallel_drafting=False,
    _enable_probabilistic_draft_probs=False, num_speculative_tokens=K, uses_mrope=False,
    positions=torch.zeros(64, dtype=torch.long), constant_draft_positions=False,
    allowed_attn_types=None, arange=torch.arange(64, dtype=torch.int32),
    token_arange_np=np.arange(64, dtype=np.int32), block_size=16,
    input_ids=torch.zeros(64, dtype=torch.int32), hidden_states=torch.zeros(64, H),
    supports_mm_inputs=False, pass_hidden_states_to_model=True, device=torch.device("cpu"),
    model=Model(), vllm_config=None,
    _sm70_mtp_profile_enabled=lambda: False, _sm70_mtp_profile_start=lambda *a: None,
    _sm70_mtp_profile_finish=lambda *a: None, _sm70_mtp_profile_add_cpu_ms=lambda *a: None,
    _sm70_mtp_profile_report=lambda *a: None,
    set_inputs_first_pass=lambda **kw: (N * (K + 1), torch.arange(N) * (K + 1) + K, kw["cad"]),
    build_per_group_and_layer_attn_metadata=lambda cad, draft_index=0: ([], {}),
    _determine_batch_execution_and_padding=lambda n, **kw: (None, n, None, None),
    build_model_inputs_first_pass=lambda n, ni, mm: (
        {"input_ids": torch.zeros(ni, dtype=torch.int32), "positions": None}, ni),
    _add_spec_step_idx=lambda kwargs, idx: {**kwargs, "spec_step_idx": idx},
    _batch_descriptor_for_spec_step=lambda desc, idx: desc, _get_slot_mapping=lambda *a: None,
    model_returns_tuple=lambda: False, _sample_draft_tokens=sample,
    _update_positions_dependent_metadata=lambda positions, *a: positions,
    _get_positions=lambda n: None, _prepare_model_kwargs_for_aot=lambda kw: kw,
)
for name, value in state.items():
    object.__setattr__(p, name, value)


def cad():
    return types.SimpleNamespace(batch_size=lambda: N, slot_mapping=None, seq_lens=None,
                                 num_actual_tokens=N * (K + 1), max_query_len=K + 1)


res["drafts"] = []
for depth in (7, 3, 1, 3, None):  # the step's depth changes from call to call
    setattr(p, auto_depth.PROPOSER_DEPTH_ATTR, depth)
    forwards.clear()
    drafts = EagleProposer.propose(p, None, None, None, torch.zeros(N, dtype=torch.long), None, cad(), None)
    res["drafts"].append({"depth": depth, "forwards": list(forwards), "shape": list(drafts.shape),
                          "rows": drafts.tolist(), "k_after": p.num_speculative_tokens,
                          "drafted": getattr(p, auto_depth.PROPOSER_DRAFTED_ATTR)})

# ---- the scheduler: 1Cat's own _update_after_schedule, the async subclass's placeholders ------
p_ = auto_depth.policy_from_env()
lo, hi = 0, 1 << 22
while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if p_.decide([mid]).k == 7 else (lo, mid)
res["threshold"] = hi


def request(num_tokens):
    return types.SimpleNamespace(num_tokens=num_tokens, num_computed_tokens=num_tokens - 1,
                                 num_output_placeholders=0, use_structured_output=False,
                                 is_prefill_chunk=False, spec_token_ids=[])


sched = object.__new__(AsyncScheduler)
for name, value in dict(num_spec_tokens=K, requests={"r0": request(hi - 2)},
                        enable_return_routed_experts=False, finished_req_ids=set(),
                        _spec_token_placeholders=(-1,) * K, _drafter_max_model_len=1 << 30,
                        log_stats=False).items():
    object.__setattr__(sched, name, value)
res["steps"] = []
for step in range(4):  # the request crosses the threshold at step 2
    r = sched.requests["r0"]
    r.num_tokens, r.num_computed_tokens = hi - 2 + step, hi - 3 + step
    out = SchedulerOutput.make_empty()
    out.num_scheduled_tokens = {"r0": 1}
    out.total_num_scheduled_tokens = 1
    sched._update_after_schedule(out)
    sent = pickle.loads(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL))  # as the executor sends it
    res["steps"].append({"depth": getattr(sent, auto_depth.DRAFT_DEPTH_ATTR, None),
                         "verify": getattr(sent, auto_depth.VERIFY_DEPTHS_ATTR, None),
                         "placeholders": len(r.spec_token_ids)})

# the verdicts of a step that verified 7 rows drafted at depth 3: the policy counts 3 positions
state_ = sched._qpn_depth
state_.verifying = {"r0": 3}
Scheduler.make_spec_decoding_stats(sched, None, num_draft_tokens=7, num_accepted_tokens=5,
                                   num_invalid_spec_tokens=None, request_id="r0")
state_.verifying = None
res["drafted"], res["accepted"] = list(state_.drafted), list(state_.accepted)
res["chosen"] = {str(k): v for k, v in state_.chosen.items()}
print("QPN_DEPTH_1CAT " + json.dumps(res))
