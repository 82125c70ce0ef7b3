# SPDX-License-Identifier: MIT
# Wraps functions of vLLM (Apache-2.0, Copyright contributors to the vLLM project); see NOTICE.
"""Log-probabilities of named tokens (``logprob_token_ids``) under speculative decoding.

A request may ask for the log-probabilities of an explicit list of token ids instead of the top k:
``/generative_scoring`` always does (its ``label_token_ids``), and chat / completions do with
``logprob_token_ids``. vLLM 0.32 and both 1Cat-vLLM builds (1.2.2, 1.3.0) compute them in the plain
``Sampler`` (``gather_specific_token_logprobs``), and their ``RejectionSampler`` was written without
them. Under MTP that kills the engine core on the first such request (found 2026-12-05):

- the rejection sampler asks the sampler for the bonus rows' whole logits
  (``max_num_logprobs=-1``, a logits mode) so that it can rebuild every verified row's
  distribution; but the sampler prefers ``logprob_token_ids`` whenever both are set and returns the
  gathered ``[rows, len(ids) + 1]`` columns. ``_get_logprobs_tensors`` then writes that into a
  ``[rows, vocab]`` buffer: "shape mismatch: value tensor of shape [3] cannot be broadcast to
  indexing result of shape [1, 512]", and the engine core dies;
- had it lived, ``_get_logprobs_tensors`` gathers the top ``len(ids)`` tokens, not the named ones;
- and a chat or completions request sends the ids without a top-k count (``logprobs`` None), so
  the rejection sampler, which computes log-probabilities only with a count, returns none for any
  step it samples (with MTP that is every step, the prompt's too): the chat endpoint's
  ``_create_chat_logprobs`` then indexes an empty list (IndexError, HTTP 500).

The fix keeps the engine's arithmetic and changes what it is asked: ``wrap_rejection_forward`` runs
the rejection sampler on sampling metadata without ``logprob_token_ids`` (so the bonus rows come
back as whole logits, as the rejection sampler expects) and with the count the plain sampler's
request would have (``SamplingParams.num_logprobs``: the number of ids), and hands the ids to
``wrap_accepted_logprobs``, which lets ``_get_logprobs_tensors`` compute every verified row's
log-probabilities as before and gathers the named tokens from them with the sampler's own
``gather_specific_token_logprobs``: the same columns (sampled token first, then the named ones, -inf
padding) and ranks that a step without speculation returns. Requests without ``logprob_token_ids``
take the engine's code unchanged.
"""
from __future__ import annotations

import dataclasses
import functools

# Calls per hook since start, read by tests (the engine's forward runs on one thread).
STATS = {"named_token_steps": 0}

_PENDING = "_qpn_logprob_token_ids"  # the ids of the step in flight, set on the sampler instance


def wrap_rejection_forward(original):
    """``RejectionSampler.forward``: the named-token request's ids held back from the sampler and
    handed to ``_get_logprobs_tensors``."""

    @functools.wraps(original)
    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        ids = getattr(sampling_metadata, "logprob_token_ids", None)
        if not ids:
            return original(self, metadata, draft_probs, logits, sampling_metadata)
        STATS["named_token_steps"] += 1
        # chat and completions send the ids without a top-k count (SamplingParams.logprobs None),
        # and the rejection sampler computes log-probabilities only with a count: give it the one
        # SamplingParams.num_logprobs gives such a request, or it returns none at all
        top = sampling_metadata.max_num_logprobs
        if top is None:
            top = max(len(named) for named in ids.values())
        plain = dataclasses.replace(sampling_metadata, logprob_token_ids=None, max_num_logprobs=top)
        setattr(self, _PENDING, ids)
        try:
            return original(self, metadata, draft_probs, logits, plain)
        finally:
            setattr(self, _PENDING, None)

    return forward


def wrap_accepted_logprobs(original):
    """``RejectionSampler._get_logprobs_tensors``: the named tokens of every verified row, when
    ``wrap_rejection_forward`` holds ids for this step."""

    @functools.wraps(original)
    def _get_logprobs_tensors(self, max_num_logprobs, metadata, logits, target_logits,
                              bonus_logits, sampled_token_ids):
        ids = getattr(self, _PENDING, None)
        if not ids:
            return original(self, max_num_logprobs, metadata, logits, target_logits, bonus_logits,
                            sampled_token_ids)
        # The function's last step is the sampler's top-k gather; for this call the sampler
        # instance gathers the named tokens instead (an instance attribute shadowing its
        # staticmethod), from the very log-probabilities the engine computed.
        sampler = self.sampler
        width = sampled_token_ids.shape[-1]  # rows are request-major: verified tokens + bonus

        def gather_named(logprobs, num_logprobs, token_ids):
            by_row = {req * width + j: named for req, named in ids.items() for j in range(width)}
            return sampler.gather_specific_token_logprobs(logprobs, by_row, token_ids)

        sampler.gather_logprobs = gather_named
        try:
            return original(self, max_num_logprobs, metadata, logits, target_logits, bonus_logits,
                            sampled_token_ids)
        finally:
            del sampler.gather_logprobs

    return _get_logprobs_tensors
