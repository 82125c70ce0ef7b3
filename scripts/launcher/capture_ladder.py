"""CUDA-graph capture sizes for speculative decoding (seed 001's capture-ladder fix).

A decode step with N running sequences and speculative depth K is N*(K+1) tokens wide. vLLM
replays a captured graph for a step only when some captured size is at least that wide; a wider
step runs fully eager, which on the SM70 fork (whose stock capture list is [1, 2]) made every
step with three or more sequences collapse. vLLM also rounds every capture size up to a multiple
of K+1 when speculating and refuses a list with none left.

So the ladder is built in units of K+1 — every size is N*(K+1) for some N — and its largest rung
is MNS*(K+1), so every width the scheduler can produce (N = 1..MNS) has a captured size at or
above it. Between 1 and MNS the rungs follow 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, ... sequences:
dense where a padded step would waste most of its width, geometric above, so that a large MNS
does not capture hundreds of graphs.

The SM70 engine's own rule. 1Cat-vLLM (1.2.2 and 1.3.0, ``EngineArgs._maybe_apply_sm70_mtp_defaults``
in ``engine/arg_utils.py``) sets capture sizes for an MTP server on a capability-7 GPU only when
none are given: a base list ([1, 2, 4, 8, 9, 18] at TP >= 4, else [1, 2, 4, 8, 9]) plus every
verification width N*(K+1) for N = 1..MNS (no verification step padded), which
``CompilationConfig.adjust_cudagraph_sizes_for_spec_decode`` then rounds up to multiples of K+1
(dropping those above the largest size). Passing our list replaces that rule, so on the sm70
engine the ladder is the union of ours and the engine's (``engine_sm70_capture_sizes``): nothing
the engine would capture is lost. The constants are checked against both archives in CI
(tests/test_engine_profile_source.py).
"""
from __future__ import annotations


class CaptureSpecError(ValueError):
    """A CAPTURE value that cannot serve the requested (MNS, K)."""


def _sequence_rungs(max_num_seqs: int) -> list[int]:
    rungs: list[int] = []
    n = 1
    while n < max_num_seqs:
        rungs.append(n)
        # 1, 2, 3, 4, then x1.5 from a power of two and x4/3 from the rung between: 6, 8, 12, ...
        if n < 4:
            n += 1
        else:
            n += n // 2 if (n & (n - 1)) == 0 else n // 3
    rungs.append(max_num_seqs)
    return rungs


def derive_capture_sizes(max_num_seqs: int, k: int) -> list[int]:
    """Capture sizes covering N*(K+1) for every N in 1..max_num_seqs, all multiples of K+1."""
    if max_num_seqs < 1:
        raise CaptureSpecError(f"MNS must be at least 1, got {max_num_seqs}")
    if k < 0:
        raise CaptureSpecError(f"K must be 0 (speculation off) or positive, got {k}")
    width = k + 1
    return [n * width for n in _sequence_rungs(max_num_seqs)]


# 1Cat-vLLM 1.2.2 / 1.3.0 engine/arg_utils.py _maybe_apply_sm70_mtp_defaults: base capture sizes.
SM70_ENGINE_BASE_TP4 = (1, 2, 4, 8, 9, 18)
SM70_ENGINE_BASE = (1, 2, 4, 8, 9)


def engine_sm70_capture_sizes(max_num_seqs: int, k: int, tp: int) -> list[int]:
    """What 1Cat's SM70 MTP defaults would capture for (MNS, K, TP), after its own rounding."""
    base = set(SM70_ENGINE_BASE_TP4 if tp >= 4 else SM70_ENGINE_BASE)
    width = k + 1
    sizes = base | ({width * n for n in range(1, max(max_num_seqs, 1) + 1)} if k > 0 else set())
    top = max(sizes)
    if width <= 1:
        return sorted(sizes)
    rounded = sorted({-(-s // width) * width for s in sizes if -(-s // width) * width <= top})
    return rounded or ([width] if width <= top else [])


def uncovered_widths(sizes: list[int], max_num_seqs: int, k: int) -> list[int]:
    """Decode widths N*(K+1), N in 1..MNS (both ends: K+1 and MNS*(K+1)), with no captured size
    at or above them (vLLM pads a step up to the next captured size; a wider one runs eager)."""
    top = max(sizes) if sizes else 0
    return [n * (k + 1) for n in range(1, max_num_seqs + 1) if n * (k + 1) > top]


def resolve_capture(spec: str | None, max_num_seqs: int, k: int, engine_rules: bool = False,
                    tp: int = 1, ladder: tuple[int, ...] | None = None) -> list[int] | None:
    """The capture list for a CAPTURE value: unset/empty -> derived ladder (with ``engine_rules``,
    the sm70 engine's: joined with ``engine_sm70_capture_sizes``); 'none' -> None (the engine's
    own default); otherwise a comma-separated list, checked to cover every width and to hold only
    multiples of K+1 (vLLM would round the others up silently). ``ladder`` (K=auto on an engine
    that verifies the drafted depth, the cpu engine): every depth of it is verified, so the
    derived list covers N*(d+1) for each depth d, and a hand-written one is refused. On 1Cat the
    launcher passes no ladder: there K=auto shortens only the drafter loop and every verify batch
    is N*(K+1) wide for the deepest K (fork_patches/spec/auto_depth.py), the widths of a fixed-K
    server, which is also all 1Cat captures full graphs for (its dispatcher's uniform decode
    query length is 1 + num_speculative_tokens, and it rounds every capture size up to a
    multiple of it)."""
    depths = tuple(ladder) if ladder else (k,)
    if spec is None or not spec.strip():
        derived: set[int] = set()
        for d in depths:
            derived |= set(derive_capture_sizes(max_num_seqs, d))
            if engine_rules and d > 0:
                derived |= set(engine_sm70_capture_sizes(max_num_seqs, d, tp))
        # The derived list is checked like a hand-written one: a ladder that stops one rung short
        # of MNS*(d+1) would leave the widest steps eager with nothing else to say so.
        for d in depths:
            missing = uncovered_widths(sorted(derived), max_num_seqs, d)
            if missing:
                raise CaptureSpecError(
                    f"the derived capture ladder {sorted(derived)} leaves decode widths {missing} "
                    f"(N*(K+1) for K={d}, N up to MNS={max_num_seqs}) uncovered: a bug in "
                    f"capture_ladder.py. Set CAPTURE to sizes reaching {max_num_seqs * (d + 1)}, "
                    "or CAPTURE=none for the engine default")
        return sorted(derived)
    if ladder and spec.strip().lower() != "none":
        raise CaptureSpecError(f"CAPTURE={spec!r} with K=auto: the widths of every depth of the "
                               f"ladder {list(ladder)} must be captured; unset CAPTURE to derive "
                               "them, or CAPTURE=none for the engine default")
    if spec.strip().lower() == "none":
        return None
    try:
        sizes = sorted({int(part) for part in spec.split(",") if part.strip()})
    except ValueError:
        raise CaptureSpecError(
            f"CAPTURE={spec!r} is not a comma-separated list of integers; "
            "unset CAPTURE to derive the ladder, or CAPTURE=none for the engine default"
        ) from None
    derived = ",".join(map(str, derive_capture_sizes(max_num_seqs, k)))
    if not sizes or sizes[0] < 1:
        raise CaptureSpecError(f"CAPTURE={spec!r}: sizes must be positive integers; "
                               f"the derived ladder for MNS={max_num_seqs}, K={k} is {derived}")
    off_grid = [s for s in sizes if s % (k + 1)]
    if off_grid:
        raise CaptureSpecError(
            f"CAPTURE={spec!r}: {off_grid} not multiples of K+1={k + 1}; with speculation every "
            f"decode step is N*(K+1) tokens wide. Use CAPTURE={derived} (or unset CAPTURE)")
    missing = uncovered_widths(sizes, max_num_seqs, k)
    if missing:
        raise CaptureSpecError(
            f"CAPTURE={spec!r}: decode widths {missing} (N*(K+1) for N up to MNS={max_num_seqs}) "
            f"exceed the largest captured size {sizes[-1]} and would run eager. "
            f"Use CAPTURE={derived} (or unset CAPTURE)")
    return sizes
