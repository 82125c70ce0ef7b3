"""Requests that killed the engine core (issue 40 item 1), below the server: the engine's own code
with and without our hooks, and the 1Cat archives read for the code the hooks rely on.

- ``logprob_token_ids`` under speculation (every /generative_scoring request; chat and completions
  with ``logprob_token_ids``): vLLM's real ``RejectionSampler`` on a batch of two speculating
  requests, its answer checked against log_softmax of the same logits computed here;
- a one-token prompt on the cpu engine's gated-delta-net prefill: the engine's own
  ``_causal_conv1d_fwd_cpu`` on the one-row column slice the model hands it.

The served form of both (HTTP status, engine alive) is in tests/test_route_policy.py.
"""
from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from tests._ci import onecat_text

pytestmark = [pytest.mark.fast]

torch = pytest.importorskip("torch")
rs = pytest.importorskip("vllm.v1.sample.rejection_sampler")
sampler_mod = pytest.importorskip("vllm.v1.sample.sampler")

from qpn.fork_patches.spec import spec_logprobs  # noqa: E402
from qpn.fork_patches.engine.engine_quirks import wrap_one_token_conv  # noqa: E402

ENGINE_FORWARD = inspect.unwrap(rs.RejectionSampler.forward)
ENGINE_LOGPROBS = inspect.unwrap(rs.RejectionSampler._get_logprobs_tensors)
VOCAB = 64
DRAFTS = [[3, 7, 11], [5, 5, 2]]  # two requests at K = 3
NAMED = {0: [9, 4], 1: [17]}  # request index -> the token ids it asks log-probabilities for


def _batch(named):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    rows = sum(len(d) + 1 for d in DRAFTS)
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(rows, VOCAB, generator=gen) * 3
    # request 0 keeps its first two drafts (the argmax there), request 1 rejects its first
    for row, token in ((0, 3), (1, 7), (4, 6)):
        logits[row, token] = 30.0
    target, bonus, start = [], [], 0
    for d in DRAFTS:
        target += list(range(start, start + len(d)))
        bonus.append(start + len(d))
        start += len(d) + 1
    cu_draft = torch.tensor([3, 6], dtype=torch.int32)
    spec = SpecDecodeMetadata(
        draft_token_ids=torch.tensor(sum(DRAFTS, []), dtype=torch.int32),
        num_draft_tokens=[len(d) for d in DRAFTS], cu_num_draft_tokens=cu_draft,
        cu_num_sampled_tokens=torch.tensor([4, 8], dtype=torch.int32),
        target_logits_indices=torch.tensor(target, dtype=torch.int32),
        bonus_logits_indices=torch.tensor(bonus, dtype=torch.int32),
        logits_indices=torch.arange(rows, dtype=torch.int32))
    width = max(len(v) for v in named.values()) if named else None
    meta = SamplingMetadata(
        temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None,
        generators={}, max_num_logprobs=width, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(2), presence_penalties=torch.zeros(2),
        repetition_penalties=torch.ones(2), output_token_ids=[[], []],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
        logprob_token_ids=named or None)
    return spec, logits, meta


def _run(forward, get_logprobs, named, top=None, clear_top=False):
    spec, logits, meta = _batch(named)
    if top is not None or clear_top:
        meta.max_num_logprobs = top
    sampler = rs.RejectionSampler(sampler_mod.Sampler("raw_logprobs"))

    class Probe(rs.RejectionSampler):  # the hooks as the plugin installs them, on a subclass
        pass

    Probe.forward = forward
    Probe._get_logprobs_tensors = get_logprobs
    sampler.__class__ = Probe
    return sampler(spec, None, logits.clone(), meta), logits


@pytest.mark.usefixtures("cpu_kernel_overrides")
def test_named_token_logprobs_under_speculation_kill_the_engines_sampler():
    """The premise: the engine's own rejection sampler dies on the request /generative_scoring
    sends (the shape mismatch seen in the server's engine core)."""
    with pytest.raises(RuntimeError, match="shape mismatch|cannot be broadcast"):
        _run(ENGINE_FORWARD, ENGINE_LOGPROBS, NAMED)


@pytest.mark.usefixtures("cpu_kernel_overrides")
def test_named_tokens_without_a_top_k_count_get_no_logprobs_from_the_engine():
    """Chat and completions send logprob_token_ids with logprobs None, so the batch's
    max_num_logprobs is None: the engine's rejection sampler returns no log-probabilities at all
    (the chat endpoint then fails with an IndexError)."""
    out, _ = _run(ENGINE_FORWARD, ENGINE_LOGPROBS, NAMED, top=None, clear_top=True)
    assert out.logprobs_tensors is None


@pytest.mark.usefixtures("cpu_kernel_overrides")
@pytest.mark.parametrize("clear_top", [False, True], ids=["scoring", "chat"])
def test_named_token_logprobs_under_speculation_are_the_named_tokens(clear_top):
    out, logits = _run(spec_logprobs.wrap_rejection_forward(ENGINE_FORWARD),
                       spec_logprobs.wrap_accepted_logprobs(ENGINE_LOGPROBS), NAMED,
                       clear_top=clear_top)
    sampled = out.sampled_token_ids
    assert sampled[0, :3].tolist() == [3, 7, int(logits[2].argmax())]  # two drafts kept, then target
    assert sampled[1, 0].item() == 6  # first draft rejected: the target's token
    expected_logprobs = torch.log_softmax(logits.double(), dim=-1)
    lp = out.logprobs_tensors
    width = max(len(v) for v in NAMED.values()) + 1
    assert tuple(lp.logprobs.shape) == (8, width)
    for req, ids in NAMED.items():
        for j in range(4):
            row = req * 4 + j
            token = int(sampled[req, j])
            if token < 0:  # a rejected position: the engine drops it in parse_output
                continue
            got_ids = lp.logprob_token_ids[row].tolist()
            assert got_ids[:1 + len(ids)] == [token] + ids, (req, j, got_ids)
            want = expected_logprobs[row, [token] + ids]
            assert torch.allclose(lp.logprobs[row, :1 + len(ids)].double(), want, atol=1e-5), (req, j)
            assert torch.isinf(lp.logprobs[row, 1 + len(ids):]).all()  # padding, as without MTP
            rank = int((logits[row] > logits[row, token]).sum()) + 1
            assert int(lp.selected_token_ranks[row]) == rank


@pytest.mark.usefixtures("cpu_kernel_overrides")
def test_plain_top_logprobs_take_the_engines_code_unchanged():
    """A request with top logprobs and no named tokens gets exactly what the engine computes."""
    want, _ = _run(ENGINE_FORWARD, ENGINE_LOGPROBS, {}, top=3)
    got, _ = _run(spec_logprobs.wrap_rejection_forward(ENGINE_FORWARD),
                  spec_logprobs.wrap_accepted_logprobs(ENGINE_LOGPROBS), {}, top=3)
    assert torch.equal(got.sampled_token_ids, want.sampled_token_ids)
    for field in ("logprob_token_ids", "logprobs", "selected_token_ranks"):
        assert torch.equal(getattr(got.logprobs_tensors, field), getattr(want.logprobs_tensors, field))


@pytest.mark.parametrize("version", ["cpu", "1.2.2", "1.3.0"])
def test_the_rejection_sampler_code_the_hooks_rely_on(version):
    """Both hooks assume, in every engine: the bonus tokens are sampled by ``self.sampler`` with
    the step's sampling metadata, ``_get_logprobs_tensors`` ends by returning
    ``self.sampler.gather_logprobs(...)``, and the sampler has ``gather_specific_token_logprobs``
    and reads ``sampling_metadata.logprob_token_ids``."""
    if version == "cpu":
        text = inspect.getsource(rs)
        sampler_text = inspect.getsource(sampler_mod)
    else:
        text = onecat_text(version, "v1/sample/rejection_sampler.py")
        sampler_text = onecat_text(version, "v1/sample/sampler.py")
    tree = ast.parse(text)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RejectionSampler")
    methods = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}
    args = [a.arg for a in methods["forward"].args.args]
    assert args == ["self", "metadata", "draft_probs", "logits", "sampling_metadata"]
    last = methods["_get_logprobs_tensors"].body[-1]
    assert isinstance(last, ast.Return)
    assert ast.unparse(last.value.func) == "self.sampler.gather_logprobs"
    assert "def gather_specific_token_logprobs(" in sampler_text
    assert "sampling_metadata.logprob_token_ids" in sampler_text
    forward = ast.unparse(methods["forward"])
    assert "self.sampler(" in forward and "max_num_logprobs=-1" in forward


# ---- a one-token prompt on the cpu engine's GDN prefill ------------------------------------------
gdn = pytest.importorskip("vllm.model_executor.layers.mamba.ops.cpu.gdn_attention")
ENGINE_CONV = inspect.unwrap(gdn._causal_conv1d_fwd_cpu)
DIM, WIDTH = 256, 4


def _conv_inputs(tokens: int):
    gen = torch.Generator().manual_seed(tokens)
    projection = torch.randn(tokens, 3 * DIM, generator=gen).to(torch.bfloat16)
    mixed_qkv = projection[:, :DIM].contiguous()  # what the engine's caller does
    return mixed_qkv, dict(
        weight=torch.randn(DIM, WIDTH, generator=gen).to(torch.bfloat16), bias=None,
        query_start_loc=torch.tensor([0, tokens], dtype=torch.int32),
        cache_indices=torch.tensor([1], dtype=torch.int32),
        has_initial_state=torch.tensor([False]), silu_activation=True, is_weight_packed=False)


def _conv_states():
    return torch.zeros(3, DIM, WIDTH - 1, dtype=torch.bfloat16)


def _needs_cpp_conv():
    if not torch.cpu._is_avx512_bf16_supported():
        pytest.skip("the engine runs this C++ conv only on AVX-512 BF16 CPUs (elsewhere its torch "
                    "conv, which takes any stride); the stride contract is checked below on every host")


def test_a_one_token_prompt_kills_the_engines_cpp_conv():
    _needs_cpp_conv()
    mixed_qkv, kw = _conv_inputs(1)
    assert mixed_qkv.is_contiguous() and mixed_qkv.stride(0) == 3 * DIM  # .contiguous() copied nothing
    with pytest.raises(RuntimeError, match="expect x to be transposed"):
        ENGINE_CONV(x=mixed_qkv.transpose(0, 1), conv_states=_conv_states(), **kw)


@pytest.mark.parametrize("tokens", [1, 2, 5])
def test_the_hooked_conv_equals_the_conv_of_a_packed_block(tokens):
    _needs_cpp_conv()
    mixed_qkv, kw = _conv_inputs(tokens)
    packed = torch.empty(tokens, DIM, dtype=torch.bfloat16)
    packed.copy_(mixed_qkv)
    want_states, got_states = _conv_states(), _conv_states()
    want = ENGINE_CONV(x=packed.transpose(0, 1), conv_states=want_states, **kw)
    got = wrap_one_token_conv(ENGINE_CONV)(x=mixed_qkv.transpose(0, 1), conv_states=got_states, **kw)
    assert torch.equal(got, want) and torch.equal(got_states, want_states)


def test_the_hook_hands_over_the_strides_the_op_checks_for():
    """On every host: the stand-in applies the C++ op's check (x the transpose of a packed
    [tokens, dim] block); the hook makes a one-row slice pass it and leaves a packed x as it is."""
    seen = []

    def op(*, x, **kwargs):
        if x.stride(1) != x.size(0):
            raise RuntimeError("causal_conv1d_fwd_cpu: expect x to be transposed.")
        seen.append(x)
        return x

    hooked = wrap_one_token_conv(op)
    mixed_qkv, _ = _conv_inputs(1)
    with pytest.raises(RuntimeError):
        op(x=mixed_qkv.transpose(0, 1))
    out = hooked(x=mixed_qkv.transpose(0, 1))
    assert torch.equal(out, mixed_qkv.transpose(0, 1))
    packed = torch.randn(4, DIM).transpose(0, 1)
    assert hooked(x=packed) is packed  # no copy where none is needed


def test_the_sm70_engines_conv_takes_any_stride():
    """On a V100 the prefill conv is 1Cat's Triton causal_conv1d_fn, which reads x's strides as
    arguments (so the one-token slice is read correctly there and the hook is cpu-only)."""
    for version in ("1.2.2", "1.3.0"):
        text = onecat_text(version, "model_executor/layers/mamba/ops/causal_conv1d.py")
        fn = textwrap.dedent(text[text.index("def causal_conv1d_fn("):])
        body = fn[: fn.index("\ndef ", 10)]
        assert "stride_x_dim = x.stride(0)" in body and "stride_x_token = x.stride(1)" in body
