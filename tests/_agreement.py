"""The end-to-end agreement rule shared by every served-checkpoint test: teacher-forced
log-probabilities of the served run against a float32 reference, within twice the floor that the
same reference run in bfloat16 shows on the same positions (mean and max of |delta log-prob|),
the engine's greedy token equal to the reference's wherever the reference is decisive, and
negative controls (references of deliberately mis-decoded checkpoints) outside the bound."""
from __future__ import annotations


def deltas(a: list[float], b: list[float]) -> tuple[float, float]:
    """(mean, max) of |a - b| over the positions."""
    d = [abs(x - y) for x, y in zip(a, b)]
    return sum(d) / len(d), max(d)


def check_agreement(got: list[float], top1: list[int], refs: dict, label: str,
                    gross: tuple[str, ...] = (), subtle: tuple[str, ...] = (),
                    floor_factor: float = 2.0) -> str:
    """Assert the rule for one served run; returns the report line (also printed).

    refs: {"float32": ..., "bfloat16": ..., control: ...}, each with token_logprobs (and, for
    float32, argmax and top2_margin) as qpn.scripts.checkpoints.checkpoint_reference writes them.
    gross: controls that must land beyond 5x the mean bound and beyond the max bound.
    subtle: controls that the bound itself must reject on both measures.
    floor_factor: the bound in multiples of the bf16 floor (2 for QPN's paths)."""
    ref = refs["float32"]
    floor_mean, floor_max = deltas(refs["bfloat16"]["token_logprobs"], ref["token_logprobs"])
    tol_mean, tol_max = floor_factor * floor_mean, floor_factor * floor_max
    mean, worst = deltas(got, ref["token_logprobs"])
    controls = {p: deltas(got, refs[p]["token_logprobs"]) for p in (*gross, *subtle)}
    report = (f"{label}, {len(got)} positions: served vs float32 mean {mean:.4f} max {worst:.4f}; "
              f"bf16 floor mean {floor_mean:.4f} max {floor_max:.4f}; controls "
              + ", ".join(f"{p} {a:.3f}/{b:.3f}" for p, (a, b) in controls.items()))
    print(report)
    assert mean <= tol_mean and worst <= tol_max, report
    # Where the float32 reference is decisive (top-2 gap above the tolerance), the engine's
    # greedy choice must be the same token.
    decisive = [i for i, m in enumerate(ref["top2_margin"]) if m > tol_max]
    assert len(decisive) >= 16, report
    assert all(top1[i] == ref["argmax"][i] for i in decisive), report
    for p in gross:
        bad_mean, bad_max = controls[p]
        assert bad_mean > 5 * tol_mean and bad_max > tol_max, f"{p}: mean {bad_mean:.3f} max {bad_max:.3f}; {report}"
    for p in subtle:
        bad_mean, bad_max = controls[p]
        assert bad_mean > tol_mean and bad_max > tol_max, f"{p}: mean {bad_mean:.3f} max {bad_max:.3f}; {report}"
    return report
