"""Sampled decoding under speculation (issue 29 items 1-2), below the server: the engine's own
rejection sampler on the cpu engine, with and without our hooks (fork_patches/spec/spec_sampling.py), and
the two 1Cat archives read for the branches that decide whether the faults reach a V100.

The distribution test drives vLLM's ``apply_sampling_constraints`` and ``rejection_sample`` (the two
steps ``RejectionSampler.forward`` runs on the drafted rows) with many requests that share one pair
of target logit rows and a greedy drafter's tokens, and tests by chi-square that each verified
position is distributed as the request's target (tests/_sampling_stats.py computes it from vLLM's
definitions in float64). Each plausible break of the pipeline (temperature, top-k or top-p not
applied, every draft accepted) must fail the same test.
"""
from __future__ import annotations

import ast
import inspect
import tarfile

import pytest

from tests._ci import onecat_archive, onecat_text
from tests._sampling_stats import chi_square, target_probs

pytestmark = [pytest.mark.fast, pytest.mark.usefixtures("cpu_kernel_overrides")]

torch = pytest.importorskip("torch")
rs = pytest.importorskip("vllm.v1.sample.rejection_sampler")
tts = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")

from qpn.fork_patches.spec import spec_sampling  # noqa: E402

# The engine's own functions, as shipped: another test in this process may have loaded our plugin,
# whose hooks carry the original in __wrapped__.
ENGINE_EXPAND = inspect.unwrap(rs.expand_batch_to_tokens)
ENGINE_TOP_K_ONLY = inspect.unwrap(tts.apply_top_k_only)

VOCAB = 48
REQUESTS = 6000
PASS_P = 1e-3  # a correct sampler fails one check in a thousand
FAIL_P = 1e-6
PROFILES = {  # name: (temperature, top_k, top_p)
    "seed AIME profile": (0.6, 20, 0.95),
    "top_k alone": (1.0, 5, None),
    "top_p alone": (0.8, None, 0.7),
}


def _expanded_reference(x, cu, replace_from=0, replace_to=0):
    out, start = [], 0
    for value, end in zip(x.tolist(), cu.tolist()):
        value = replace_to if value == replace_from else value
        out += [value] * (end - start)
        start = end
    return out


def test_the_engines_cpu_expand_leaves_a_non_int64_output_unwritten():
    """The fault itself, deterministically: the C++ stand-in fills an int64 copy of a float32 or
    int32 output, so an output filled beforehand keeps its fill."""
    from vllm.utils import cpu_triton_utils

    cu = torch.tensor([2, 3], dtype=torch.int32)
    for dtype, fill in ((torch.float32, float("nan")), (torch.int32, -7)):
        out = torch.full((3,), fill, dtype=dtype)
        cpu_triton_utils._expand_kernel_impl(out, torch.tensor([5, 9], dtype=dtype), cu, 0, 0)
        kept = torch.isnan(out) if dtype.is_floating_point else out == fill
        assert bool(kept.all()), (dtype, out)
    out = torch.full((3,), -7, dtype=torch.int64)
    cpu_triton_utils._expand_kernel_impl(out, torch.tensor([5, 9]), cu, 0, 0)
    assert out.tolist() == [5, 5, 9]


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64, torch.float64])
def test_expand_hook_gives_every_request_its_value_per_drafted_token(dtype):
    """Every dtype; requests with 0, 1 and the engine's maximum of drafts; the temperature's
    0 -> 1 substitution; a float that truncation to int64 would change."""
    expand = spec_sampling.wrap_expand_batch_to_tokens(ENGINE_EXPAND)
    counts = [0, 1, 3, rs.MAX_SPEC_LEN, 0, 7]
    cu = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    floats = dtype.is_floating_point
    x = torch.tensor([0.6, 0, 1.0, 0.95, 2.5, 20] if floats else [20, 0, 1, 5, 248320, 7], dtype=dtype)
    for rf, rt in ((0, 0), (0, 1)):
        got = expand(x, cu, sum(counts), replace_from=rf, replace_to=rt)
        assert got.dtype == dtype and got.shape == (sum(counts),)
        assert got.tolist() == pytest.approx(_expanded_reference(x, cu, rf, rt)), (dtype, rf, rt)
    empty = expand(x, torch.zeros(len(counts), dtype=torch.int32), 0)
    assert empty.numel() == 0 and empty.dtype == dtype
    with pytest.raises(ValueError, match="expected 5"):
        expand(x, cu, 5)


def test_empty_top_k_batch_is_returned_and_others_are_the_engines():
    """The engine's apply_top_k_only dies on zero rows; the hook returns them. A full batch
    (k from 1 to the vocabulary, i.e. no top-k) gets exactly the engine's mask."""
    with pytest.raises(RuntimeError, match="numel\\(\\) == 0"):
        ENGINE_TOP_K_ONLY(torch.zeros((0, VOCAB)), torch.zeros(0, dtype=torch.int32))
    hooked = spec_sampling.wrap_apply_top_k_only(ENGINE_TOP_K_ONLY)
    empty = torch.zeros((0, VOCAB))
    assert hooked(empty, torch.zeros(0, dtype=torch.int32)) is empty
    g = torch.Generator().manual_seed(3)
    logits = torch.randn((4, VOCAB), generator=g)
    k = torch.tensor([1, 2, VOCAB - 1, VOCAB], dtype=torch.int32)
    want = ENGINE_TOP_K_ONLY(logits.clone(), k.clone())
    got = hooked(logits.clone(), k.clone())
    assert torch.equal(got, want)
    assert [int(torch.isfinite(r).sum()) for r in got] == [1, 2, VOCAB - 1, VOCAB]


def _drafted_batch(profile, g):
    """(target logits [REQUESTS*2, V], per-position logit rows, drafted tokens, metadata): every
    request drafts the same two tokens (a greedy drafter's argmax of its own logits) over the same
    two target rows."""
    from types import SimpleNamespace

    temperature, top_k, top_p = profile
    rows = torch.randn((2, VOCAB), generator=g, dtype=torch.float32) * 2
    drafter = rows + torch.randn((2, VOCAB), generator=g) * 1.5  # a drafter that often disagrees
    drafts = drafter.argmax(dim=-1)
    n = REQUESTS
    md = SimpleNamespace(
        all_greedy=False, all_random=True, generators={},
        temperature=torch.full((n,), temperature, dtype=torch.float32),
        top_k=None if top_k is None else torch.full((n,), top_k, dtype=torch.int32),
        top_p=None if top_p is None else torch.full((n,), top_p, dtype=torch.float32))
    return rows.repeat(n, 1), rows, drafts, md


def _verify(profile, seed, expand=None, uniform=None):
    """Outputs [REQUESTS, 3] of the engine's constraint + rejection steps, our hooks in place
    (``expand``/``uniform`` replace the expansion or the uniform draws to break the pipeline)."""
    g = torch.Generator().manual_seed(seed)
    logits, rows, drafts, md = _drafted_batch(profile, g)
    n = REQUESTS
    cu = torch.arange(2, 2 * n + 1, 2, dtype=torch.int32)
    saved = rs.expand_batch_to_tokens, tts.apply_top_k_only, rs.generate_uniform_probs
    try:
        rs.expand_batch_to_tokens = expand or spec_sampling.wrap_expand_batch_to_tokens(ENGINE_EXPAND)
        tts.apply_top_k_only = spec_sampling.wrap_apply_top_k_only(ENGINE_TOP_K_ONLY)
        if uniform is not None:
            rs.generate_uniform_probs = uniform
        target = rs.apply_sampling_constraints(logits, cu, md)
        out = rs.rejection_sample(drafts.repeat(n).to(torch.int32), [2] * n, 2, cu, None, target,
                                  torch.full((n, 1), VOCAB - 1, dtype=torch.int64), md)
    finally:
        rs.expand_batch_to_tokens, tts.apply_top_k_only, rs.generate_uniform_probs = saved
    return out, rows, drafts


def _p_values(profile, out, rows, drafts):
    """Chi-square p-value of position 0, and of position 1 among requests whose first draft was
    accepted, against the profile's target distribution."""
    temperature, top_k, top_p = profile
    first = out[:, 0].tolist()
    p0 = chi_square(first, target_probs(rows[0].tolist(), temperature, top_k, top_p))[2]
    kept = out[out[:, 0] == drafts[0]]
    assert len(kept) > 200, "too few accepted first drafts for a test of the second position"
    p1 = chi_square(kept[:, 1].tolist(), target_probs(rows[1].tolist(), temperature, top_k, top_p))[2]
    return p0, p1


@pytest.mark.parametrize("name", PROFILES)
def test_verified_tokens_follow_the_target_distribution(name):
    profile = PROFILES[name]
    out, rows, drafts = _verify(profile, seed=11)
    p0, p1 = _p_values(profile, out, rows, drafts)
    assert p0 > PASS_P and p1 > PASS_P, (name, p0, p1)


def _ignoring(which):
    """An expansion that drops one sampling parameter: the plausible bugs of this step."""
    def expand(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        out = spec_sampling.expand_in_torch(x, cu_num_tokens, num_tokens, replace_from, replace_to)
        if which == "temperature" and x.dtype == torch.float32 and replace_to == 1:
            return torch.ones_like(out)
        if which == "top_k" and x.dtype == torch.int32:
            return torch.full_like(out, VOCAB)
        if which == "top_p" and x.dtype == torch.float32 and replace_to == 0:
            return torch.ones_like(out)
        return out
    return expand


@pytest.mark.parametrize("name, broken", [
    ("seed AIME profile", "temperature"), ("top_k alone", "top_k"), ("top_p alone", "top_p"),
    ("top_p alone", "temperature"), ("seed AIME profile", "always accept")])
def test_a_broken_sampler_fails_the_distribution_test(name, broken):
    profile = PROFILES[name]
    if broken == "always accept":
        out, rows, drafts = _verify(profile, seed=11, uniform=lambda n, *a: torch.zeros(n, dtype=torch.float64))
        p0 = chi_square(out[:, 0].tolist(), target_probs(rows[0].tolist(), *profile))[2]
        assert p0 < FAIL_P, p0
        return
    out, rows, drafts = _verify(profile, seed=11, expand=_ignoring(broken))
    assert min(_p_values(profile, out, rows, drafts)) < FAIL_P, (name, broken)


# ---- the 1Cat archives: why neither fault reaches the sm70 engine on CUDA

def _archive_tree(version: str, relpath: str) -> ast.Module:
    return ast.parse(onecat_text(version, relpath))


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    return next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)


def _calls_under(node, callee: str, guards=()):
    """(call, the tests of the ifs whose body holds it, as source) for each call of ``callee``."""
    found = []
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == callee:
        found.append((node, guards))
    for field, value in ast.iter_fields(node):
        children = value if isinstance(value, list) else [value]
        for child in children:
            if not isinstance(child, ast.AST):
                continue
            extra = (ast.unparse(node.test),) if isinstance(node, ast.If) and field == "body" else ()
            found += _calls_under(child, callee, guards + extra)
    return found


@pytest.mark.parametrize("version", ["1.2.2", "1.3.0"])
def test_on_1cat_cuda_the_cpu_top_k_mask_is_never_reached(version):
    tree = _archive_tree(version, "v1/sample/ops/topk_topp_sampler.py")
    only = _calls_under(_function(tree, "apply_top_k_top_p_pytorch"), "apply_top_k_only")
    assert only and all("allow_cpu_sync" in g for _, g in only), only
    for call, guards in _calls_under(_function(tree, "apply_top_k_top_p"), "apply_top_k_top_p_pytorch"):
        sync = [k for k in call.keywords if k.arg == "allow_cpu_sync"]
        if sync and not (isinstance(sync[0].value, ast.Constant) and sync[0].value.value is False):
            assert "current_platform.is_cpu()" in guards, ast.unparse(call)


@pytest.mark.parametrize("version", ["1.2.2", "1.3.0"])
def test_on_1cat_cuda_the_expansion_is_the_triton_kernel(version):
    tree = _archive_tree(version, "v1/sample/rejection_sampler.py")
    kernel = _function(tree, "expand_kernel")
    assert any("triton.jit" in ast.unparse(d) for d in kernel.decorator_list)
    launches = [n for n in ast.walk(_function(tree, "expand_batch_to_tokens"))
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript)
                and ast.unparse(n.func.value) == "expand_kernel"]
    assert len(launches) == 1
    # the C++ stand-ins are swapped in by the CPU model runner alone
    with tarfile.open(onecat_archive(version)) as tar:
        users = [m.name.split("/vllm/", 1)[1] for m in tar if m.isfile() and m.name.endswith(".py")
                 and "cpu_triton_utils" in tar.extractfile(m).read().decode("utf-8", "replace")
                 and not m.name.endswith("cpu_triton_utils.py")]
    assert users == ["v1/worker/cpu_model_runner.py"], users
