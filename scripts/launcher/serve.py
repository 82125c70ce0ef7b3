"""Serve a mixed NVFP4/FP8 checkpoint through vLLM and refuse to report success unless the
boot gates pass.  Entry point of ``scripts/serve-qwen38-native.sh``.

    python -m qpn.scripts.launcher.serve CKPT [extra vLLM arguments...]

Settings come from the environment (see docs/serving.md): K (speculative depth, default 7,
0 = off), MML, MNS (default 1), GMU, TP, PORT (8000), HOST (127.0.0.1), CAPTURE (capture sizes;
default derived from MNS and K, ``none`` = engine default), ENV_PREFIX / QPN_ENGINE_PYTHON
(the engine), ENGINE (cpu|sm70, default read from the engine), VLLM_API_KEY, THINKING
(default true), TOOL_PARSER, SERVED_NAME, RUN_DIR, BOOT_TIMEOUT, MAX_N (most choices per request,
default 4; scripts/launcher/request_limits.py).

Order of events: every refusal check (before any engine process exists); the server in its own
process group with a fresh census directory; /v1/models; one warm greedy chat (K=auto: and a
long one, sized to the served max_model_len); the gates (census + /metrics + the warm reply);
on any failure the server and all its children are stopped and the exit status is 1; on success
the gate table is printed and written as JSON and the launcher stays in the foreground, watching
the engine core's /health, until interrupted (then it stops the server and exits 0) or until the
engine dies (then it reports the root error and the error lines of the server log, never a
WARNING, and exits 1). During the boot a progress line every 5 s names the phase.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from qpn.fork_patches.spec import depth_policy
from qpn.scripts.launcher import boot_gates, request_limits, serve_preflight
from qpn.scripts.launcher.capture_ladder import CaptureSpecError, resolve_capture
from qpn.scripts.launcher.engine_profiles import (
    PROFILES, EngineNotFound, EngineProfile, detect_engine, tp_env,
)
from qpn.scripts.launcher.launched import group_alive
from qpn.scripts.launcher.serve_preflight import Refusal

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_PORT = 8000
DEFAULT_K = 7


def log(message: str) -> None:
    print(f"[serve] {message}", flush=True)


def warn(message: str) -> None:
    print(f"[serve] WARNING: {message}", file=sys.stderr, flush=True)


# ---- settings --------------------------------------------------------------------------------

def _int_setting(environ: dict[str, str], name: str, default: int | None) -> int | None:
    raw = environ.get(name, "")
    if raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise Refusal(f"{name}={raw!r} is not an integer") from None


def engine_python(environ: dict[str, str]) -> str:
    """The python that runs vLLM: QPN_ENGINE_PYTHON, else ENV_PREFIX/bin/python, else the
    repository's engine virtualenv (.venv-sm70, then .venv-cpu)."""
    if environ.get("QPN_ENGINE_PYTHON"):
        candidates = [environ["QPN_ENGINE_PYTHON"]]
    elif environ.get("ENV_PREFIX"):
        candidates = [os.path.join(environ["ENV_PREFIX"], "bin", "python")]
    else:
        candidates = [os.path.join(REPO_ROOT, venv, "bin", "python")
                      for venv in (".venv-sm70", ".venv-cpu")]
    for candidate in candidates:
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise Refusal(f"no engine python at {' or '.join(candidates)}. Create the engine first: "
                  "ENGINE=cpu ENV_PREFIX=<dir> bash scripts/bootstrap-sm70.sh (or set "
                  "ENV_PREFIX / QPN_ENGINE_PYTHON to an existing one)")


def tool_parser_for(ckpt: str) -> str | None:
    """The vLLM tool parser matching the tool-call format the checkpoint's chat template asks
    the model to write: XML function blocks (Qwen3.5 family) or JSON inside <tool_call>.
    XML blocks get ``qwen3_coder``: the parser 1Cat-vLLM recommends for Qwen3.x (its README's
    serve commands); 1Cat's ``qwen3_xml`` is a different implementation, and in vLLM 0.32 both
    names load the same parser class."""
    texts = []
    jinja = os.path.join(ckpt, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja) as f:
            texts.append(f.read())
    tok_cfg = os.path.join(ckpt, "tokenizer_config.json")
    if os.path.isfile(tok_cfg):
        with open(tok_cfg) as f:
            template = json.load(f).get("chat_template") or ""
        texts.append(template if isinstance(template, str) else json.dumps(template))
    text = "\n".join(texts)
    if "<function=" in text:
        return "qwen3_coder"
    if "<tool_call>" in text:
        return "hermes"
    return None


@dataclass
class Launch:
    ckpt: str
    extra_args: list[str]
    k: int
    mns: int
    mml: int | None
    gmu: float | None
    tp: int | None
    host: str
    port: int
    capture: list[int] | None
    python: str
    profile: EngineProfile
    engine_version: str
    served_name: str
    tool_parser: str | None
    thinking: bool
    api_key: str | None
    run_dir: str
    boot_timeout: float
    max_n: int = 4
    regions: set[str] = field(default_factory=set)
    environ: dict[str, str] = field(default_factory=dict)
    depth: depth_policy.DepthPolicy | None = None  # K=auto; None: the fixed depth k

    @property
    def probe_host(self) -> str:
        if self.host in ("0.0.0.0", ""):
            return "127.0.0.1"
        if self.host == "::":
            return "[::1]"
        return f"[{self.host}]" if ":" in self.host else self.host

    @property
    def root_url(self) -> str:
        return f"http://{self.probe_host}:{self.port}"

    @property
    def census_dir(self) -> str:
        return os.path.join(self.run_dir, "census")

    @property
    def gates_json(self) -> str:
        return self.environ.get("GATES_JSON") or os.path.join(self.run_dir, "gates.json")

    @property
    def server_log(self) -> str:
        return os.path.join(self.run_dir, "server.log")


def quant_config(ckpt: str, config: dict) -> dict | None:
    path = os.path.join(ckpt, "hf_quant_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    return config.get("quantization_config")


def prepare(argv: list[str], environ: dict[str, str]) -> Launch:
    """Every check that can refuse, in the order a user would want to hear about them. Starts
    no engine process (detect_engine only reads package metadata)."""
    if not argv or argv[0] in ("-h", "--help"):
        raise Refusal("usage: bash scripts/serve-qwen38-native.sh CKPT_DIR [extra vLLM args]")
    ckpt, extra = os.path.abspath(argv[0]), list(argv[1:])
    host = environ.get("HOST") or "127.0.0.1"
    serve_preflight.check_bind(host, environ)
    port = _int_setting(environ, "PORT", DEFAULT_PORT)
    serve_preflight.check_port(host, port)
    config = serve_preflight.load_checkpoint_config(argv[0])
    depth = auto_depth_policy(environ)
    k = depth.max_depth if depth else _int_setting(environ, "K", DEFAULT_K)
    serve_preflight.check_depth(k, config, ckpt)
    mns = _int_setting(environ, "MNS", 1)
    if mns < 1:
        raise Refusal(f"MNS={mns}: at least one sequence must be schedulable")
    python = engine_python(environ)
    try:
        profile, version = detect_engine(python)
    except EngineNotFound as exc:
        raise Refusal(str(exc)) from None
    if environ.get("ENGINE"):
        if environ["ENGINE"] not in PROFILES:
            raise Refusal(f"ENGINE={environ['ENGINE']!r}: known engines are {sorted(PROFILES)}")
        if environ["ENGINE"] != profile.name:
            raise Refusal(f"ENGINE={environ['ENGINE']} but {python} has the {profile.name} engine"
                          f" ({profile.distribution} {version}); point ENV_PREFIX at the right "
                          "engine or drop ENGINE")
    if depth and profile.no_per_step_depth:
        raise Refusal(f"K=auto on the {profile.name} engine: {profile.no_per_step_depth}")
    if depth:
        depth = auto_depth_for_engine(depth, profile, environ)
        if depth.max_depth != k:
            k = depth.max_depth
            serve_preflight.check_depth(k, config, ckpt)
    try:
        # K=auto verifies each ladder depth's width where the engine schedules the depth; where
        # it only shortens the drafter loop ("draft") every verify batch is the deepest's.
        capture = resolve_capture(environ.get("CAPTURE"), mns, k, profile.engine_capture_rules,
                                  _int_setting(environ, "TP", profile.default_tensor_parallel) or 1,
                                  ladder=verified_depths(depth, profile))
    except CaptureSpecError as exc:
        raise Refusal(str(exc)) from None
    if profile.checks_gpus:
        serve_preflight.check_gpus_free(environ.get("NVIDIA_SMI", "nvidia-smi"),
                                        environ.get("CUDA_VISIBLE_DEVICES"))
    mml = _int_setting(environ, "MML", profile.default_max_model_len)
    gmu_raw = environ.get("GMU", "")
    try:
        gmu = float(gmu_raw) if gmu_raw else profile.default_gpu_memory_utilization
    except ValueError:
        raise Refusal(f"GMU={gmu_raw!r} is not a number (fraction of GPU memory, e.g. 0.88)"
                      ) from None
    tp = _int_setting(environ, "TP", profile.default_tensor_parallel)
    if tp is not None and tp < 1:
        raise Refusal(f"TP={tp}: tensor parallelism needs at least one device")
    serve_preflight.check_tp_split(ckpt, tp, environ)
    try:
        tp_env(profile, tp or 1)
    except ValueError as exc:
        raise Refusal(str(exc)) from None
    run_dir = environ.get("RUN_DIR") or tempfile.mkdtemp(prefix="qpn-serve-")
    if os.path.exists(os.path.join(run_dir, "census")):
        # an earlier run's census would be read as this server's
        raise Refusal(f"RUN_DIR={run_dir} already holds a census from an earlier run; choose a "
                      "new RUN_DIR (or leave it unset for a fresh one)")
    os.makedirs(run_dir, exist_ok=True)
    tool_parser = environ.get("TOOL_PARSER") or tool_parser_for(ckpt)
    max_n = _int_setting(environ, "MAX_N", request_limits.DEFAULT_MAX_N)
    if max_n < 1:
        raise Refusal(f"MAX_N={max_n}: a request must be allowed at least one choice")
    return Launch(
        ckpt=ckpt, extra_args=extra, k=k, mns=mns, mml=mml, gmu=gmu, tp=tp, host=host, port=port,
        capture=capture, python=python, profile=profile, engine_version=version,
        served_name=environ.get("SERVED_NAME") or os.path.basename(ckpt.rstrip("/")),
        tool_parser=None if tool_parser == "none" else tool_parser,
        thinking=environ.get("THINKING", "true").lower() not in ("0", "false", "no", "off"),
        api_key=environ.get("VLLM_API_KEY") or None, run_dir=run_dir,
        boot_timeout=_int_setting(environ, "BOOT_TIMEOUT", 900), max_n=max_n,
        regions=boot_gates.declared_regions(quant_config(ckpt, config)), environ=environ,
        depth=depth)


def verified_depths(depth: depth_policy.DepthPolicy | None,
                    profile: EngineProfile) -> tuple[int, ...] | None:
    """The depths whose verify widths the capture ladder must cover under K=auto: every ladder
    depth where the engine verifies the drafted depth; None (the deepest, K, alone) where it
    verifies the deepest depth's width every round (1Cat) or at a fixed depth."""
    return depth.ladder if depth and profile.per_step_depth == "schedule" else None


def auto_depth_for_engine(depth: depth_policy.DepthPolicy, profile: EngineProfile,
                          environ: dict[str, str]) -> depth_policy.DepthPolicy:
    """K=auto's policy as ``profile``'s engine applies it. Where the engine only shortens the
    drafter loop and verifies the deepest depth's width every round (``per_step_depth ==
    "draft"``, 1Cat: fork_patches/spec/auto_depth.py) the policy prices that (``fixed_verify``), a
    ladder with 0 is refused, and an unset or ``auto`` DEPTH_LADDER is the profile's ladder."""
    if profile.per_step_depth != "draft":
        return depth
    ladder = environ.get("DEPTH_LADDER", "").strip()
    default = profile.auto_ladder if not ladder or ladder.lower() == "auto" else None
    try:
        return dataclasses.replace(depth, fixed_verify=True,
                                   **({"ladder": default} if default else {}))
    except ValueError as exc:
        raise Refusal(f"K=auto on the {profile.name} engine: {exc}") from None


def auto_depth_policy(environ: dict[str, str]) -> depth_policy.DepthPolicy | None:
    """K=auto's policy from DEPTH_LADDER / DEPTH_CONSTANTS / DEPTH_PRIOR_ROUNDS (None for a
    fixed K); a bad setting is refused, naming it."""
    if environ.get("K", "").strip().lower() != "auto":
        for name in ("DEPTH_LADDER", "DEPTH_CONSTANTS", "DEPTH_PRIOR_ROUNDS"):
            if environ.get(name, "").strip():
                raise Refusal(f"{name} is set but K={environ.get('K') or DEFAULT_K} is a fixed "
                              "depth: set K=auto to use it, or unset it")
        return None
    rounds = environ.get("DEPTH_PRIOR_ROUNDS", "").strip()
    try:
        return depth_policy.policy_from_settings(
            environ.get("DEPTH_LADDER", "").strip() or "auto",
            environ.get("DEPTH_CONSTANTS", "").strip() or None,
            float(rounds) if rounds else depth_policy.DEFAULT_PRIOR_ROUNDS)
    except ValueError as exc:
        raise Refusal(f"K=auto: {exc}") from None


def server_command(launch: Launch) -> list[str]:
    p = launch.profile
    cmd = [launch.python, "-m", "vllm.entrypoints.openai.api_server",
           "--model", launch.ckpt, "--served-model-name", launch.served_name,
           "--host", launch.host, "--port", str(launch.port),
           "--max-num-seqs", str(launch.mns), *p.vllm_args]
    if launch.mml:
        cmd += ["--max-model-len", str(launch.mml)]
    if launch.gmu is not None:
        cmd += ["--gpu-memory-utilization", str(launch.gmu)]
    if launch.tp is not None:
        cmd += ["--tensor-parallel-size", str(launch.tp)]
    if launch.k > 0:
        spec = {"method": "mtp", "num_speculative_tokens": launch.k, **p.speculative_extra}
        if launch.depth and p.per_step_depth == "schedule":
            # vLLM's per-step depth path, on for every batch size at the deepest depth; the
            # auto-depth-per-step hook replaces its answer each step (fork_patches/spec/auto_depth.py).
            # 1Cat has no such field: its hooks need nothing from the engine's config.
            spec["num_speculative_tokens_per_batch_size"] = [[1, launch.mns, launch.k]]
        cmd += ["--speculative-config", json.dumps(spec)]
    if p.uses_cuda_graphs and launch.capture is not None:
        cmd += ["--compilation-config", json.dumps({"cudagraph_capture_sizes": launch.capture})]
    cmd += ["--reasoning-parser", "qwen3",
            "--default-chat-template-kwargs", json.dumps({"enable_thinking": launch.thinking})]
    if launch.tool_parser:
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", launch.tool_parser]
    # n / best_of / max_tokens limits (scripts/launcher/request_limits.py): vLLM's middleware flag
    cmd += ["--middleware", "qpn.scripts.launcher.request_limits.RequestLimits"]
    return cmd + launch.extra_args


def server_env(launch: Launch) -> dict[str, str]:
    env = dict(launch.environ)
    for key, value in launch.profile.env_defaults.items():
        env.setdefault(key, value)
    for key, value in tp_env(launch.profile, launch.tp or 1).items():
        env.setdefault(key, value)
    env["QPN_CENSUS_DIR"] = launch.census_dir
    if launch.depth:
        from qpn.fork_patches.spec import auto_depth

        env[auto_depth.ENV_LADDER] = ",".join(map(str, launch.depth.ladder))
        env[auto_depth.ENV_PRIOR_ROUNDS] = repr(launch.depth.prior_rounds)
        env[auto_depth.ENV_CONSTANTS] = json.dumps(launch.depth.costs.as_dict())
        if launch.depth.fixed_verify:
            env[auto_depth.ENV_VERIFY] = auto_depth.VERIFY_DEEPEST
    env["QPN_MAX_N"] = env["VLLM_MAX_N_SEQUENCES"] = str(launch.max_n)
    if launch.mml:
        env["QPN_MAX_MODEL_LEN"] = str(launch.mml)
    # vLLM leaves its ZMQ socket files here; inside the run directory they go with it.
    env.setdefault("VLLM_RPC_BASE_PATH", launch.run_dir)
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    # From a source checkout, make `qpn` (the overlay plugin) importable in the engine
    # processes; an install has it in site-packages already.
    if os.path.isfile(os.path.join(REPO_ROOT, "qpn", "__init__.py")):
        env["PYTHONPATH"] = os.pathsep.join(
            [REPO_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


# ---- the server process ----------------------------------------------------------------------

class Server:
    def __init__(self, launch: Launch):
        self.launch = launch
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        os.makedirs(self.launch.census_dir, exist_ok=False)
        with open(self.launch.server_log, "w") as out:
            self.proc = subprocess.Popen(
                server_command(self.launch), stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=server_env(self.launch), cwd=self.launch.run_dir,
                start_new_session=True)  # own process group: the engine core goes with it

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM the server (its engine children follow within seconds), then make sure
        nothing of its process group is left, escalating only if something is."""
        if self.proc is None:
            return
        pid = self.proc.pid
        if self.proc.poll() is None:
            # The first SIGTERM shuts the engine down and then waits for open client
            # connections; a second one makes the HTTP server stop waiting for them.
            for signum, wait_s in ((signal.SIGTERM, 10), (signal.SIGTERM, 20)):
                self.proc.send_signal(signum)
                try:
                    self.proc.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
            else:
                warn(f"server pid {pid} did not exit after two SIGTERMs; killing its group")
                os.killpg(pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        deadline = time.monotonic() + 15
        while group_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if group_alive(pid):
            warn(f"processes of server group {pid} outlived it; killing them")
            os.killpg(pid, signal.SIGKILL)
        log(f"server stopped (pid {pid}, exit {self.proc.returncode}); "
            "no process of its group is left")

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.launch.server_log, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no server log)"


class BootFailure(RuntimeError):
    pass


def _request(launch: Launch, path: str, body: dict | None = None, timeout: float = 10
             ) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if launch.api_key:
        headers["Authorization"] = f"Bearer {launch.api_key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(launch.root_url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


# What the server log says about the boot, in order; the last phase seen is the one reported.
BOOT_PHASES = (
    ("non-default args", "API server reading its configuration"),
    ("Resolved architecture", "resolving the model's architecture"),
    ("Initializing a V1 LLM engine", "engine core starting"),
    ("Starting to load model", "loading weights"),
    ("Loading weights took", "weights loaded; prepacking (QPN layers, inverse check)"),
    ("Loading drafter model", "loading the MTP drafter"),
    ("KV cache size", "KV cache allocated"),
    ("init engine (profile, create kv cache, warmup model)", "engine warm-up done"),
    ("Capturing CUDA graph", "CUDA graph capture"),
    ("Graph capturing finished", "CUDA graphs captured"),
    ("Starting vLLM server on", "API server starting"),
)
PROGRESS_PERIOD_S = 5.0


class BootProgress:
    """A line every PROGRESS_PERIOD_S during the boot: elapsed time, the phase the server log
    shows, and the prepack count the overlay's census holds (modules prepacked, how many passed
    the byte-identical inverse check)."""

    def __init__(self, launch: Launch, period_s: float = PROGRESS_PERIOD_S):
        self.launch = launch
        self.period_s = period_s
        self.start = time.monotonic()
        self.last_print = self.start
        self.offset = 0
        self.phase = "starting the server process"

    def _read_log(self) -> None:
        try:
            with open(self.launch.server_log, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return
        cut = chunk.rfind(b"\n") + 1
        self.offset += cut
        for line in chunk[:cut].decode(errors="replace").splitlines():
            for needle, phase in BOOT_PHASES:
                if needle in line:
                    self.phase = phase

    def prepack(self) -> str | None:
        try:
            from qpn.fork_patches.route_census.census import read_rank_files

            ranks = read_rank_files(self.launch.census_dir)
        except Exception:  # noqa: BLE001 - progress is best effort; the gates judge the census
            return None
        modules = [m for r in ranks for m in r.get("modules", {}).values()]
        if not modules:
            return None
        verified = sum(1 for m in modules if m.get("prepack_verified"))
        return (f"prepack: {len(modules)} modules over {len(ranks)} rank(s), {verified} verified by the "
                "inverse check")

    def line(self, phase: str | None = None) -> str:
        """The progress line; ``phase`` names a step of the launcher's own (the warm request),
        which the server log does not show."""
        self._read_log()
        parts = [f"boot {time.monotonic() - self.start:.0f} s: {phase or self.phase}"]
        if (pp := self.prepack()) is not None:
            parts.append(pp)
        return "; ".join(parts)

    def tick(self, force: bool = False, phase: str | None = None) -> None:
        now = time.monotonic()
        if force or now - self.last_print >= self.period_s:
            self.last_print = now
            log(self.line(phase))


def wait_for_models(server: Server, progress: BootProgress | None = None) -> str:
    launch = server.launch
    deadline = time.monotonic() + launch.boot_timeout
    while time.monotonic() < deadline:
        if progress is not None:
            progress.tick()
        if not server.alive():
            raise BootFailure(f"server exited during boot (exit {server.proc.returncode}); "
                              f"last lines of {launch.server_log}:\n{server.log_tail()}")
        try:
            status, body = _request(launch, "/v1/models", timeout=3)
            if status == 200:
                return json.loads(body)["data"][0]["id"]
            if status == 401:
                raise BootFailure("/v1/models answered 401: VLLM_API_KEY differs from the key "
                                  "the server uses")
        except (OSError, ValueError):
            pass
        time.sleep(1.0)
    raise BootFailure(f"/v1/models did not answer within {launch.boot_timeout:.0f} s "
                      f"(BOOT_TIMEOUT); last lines of {launch.server_log}:\n{server.log_tail()}")


# K=auto's second warm request: a prompt of about this many words, so the policy decides for a
# long live context too (DEPTH_WARM_WORDS overrides it); cut to what the served max_model_len holds.
LONG_WARM_WORDS = 1500
WARM_MAX_TOKENS = 8
# Tokens the long warm request leaves free beyond its completion: slack for a server that renders
# or counts the chat a few tokens differently from the checkpoint's tokenizer here.
LONG_WARM_SLACK = 16


def warm_request(launch: Launch, model: str, prompt: str = "Say ready.") -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "temperature": 0.0, "max_tokens": WARM_MAX_TOKENS, "seed": 0,
            "chat_template_kwargs": {"enable_thinking": False}}
    try:
        status, raw = _request(launch, "/v1/chat/completions", body, timeout=600)
    except OSError as exc:
        return {"ok": False, "error": f"request failed: {exc}"}
    if status != 200:
        return {"ok": False, "error": f"HTTP {status}: {raw[:200]!r}"}
    try:
        reply = json.loads(raw)
        choice = reply["choices"][0]["message"]
        tokens = int(reply["usage"]["completion_tokens"])
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        return {"ok": False, "error": f"malformed reply ({exc}): {raw[:200]!r}"}
    return {"ok": True, "completion_tokens": tokens, "content": choice.get("content"),
            "prompt_tokens": int(reply["usage"].get("prompt_tokens") or 0)}


def long_warm_prompt(words: int) -> str:
    """A prompt of ``words`` words of ordinary text, ending in a short question."""
    text = ("The committee met again on Thursday to review the figures from the spring survey and "
            "to agree on the wording of the summary that will go to the members next month. ")
    filler = text.split()
    return " ".join(filler[i % len(filler)] for i in range(words)) + " What did the committee do?"


def chat_token_counter(ckpt: str):
    """(count, None), ``count(text)`` being the prompt tokens of a one-message chat of ``text`` as
    the server builds it (the checkpoint's chat template, thinking off, with the generation
    prompt, rendered and then encoded without added special tokens, as vLLM does) with the
    checkpoint's own tokenizer; or (None, why) when that tokenizer cannot be loaded here."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(ckpt)
    except Exception as exc:  # noqa: BLE001 - any failure: the caller falls back to a bound
        return None, f"{type(exc).__name__}: {exc}"[:200]

    def count(text: str) -> int:
        chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True, enable_thinking=False)
        return len(tok(chat, add_special_tokens=False, verbose=False)["input_ids"])

    return count, None


@dataclass(frozen=True)
class LongWarm:
    """K=auto's long warm request, sized to the served max_model_len: ``words`` of
    long_warm_prompt (0: not sent), ``tokens`` its prompt tokens as counted before sending."""

    asked: int
    words: int
    tokens: int
    mml: int | None
    counted: str  # how the tokens were counted

    @property
    def cut(self) -> bool:
        return self.words < self.asked

    def note(self, prompt_tokens: int | None = None) -> str:
        """The warm_request gate's words on it; ``prompt_tokens``: what the server counted."""
        served = f"{prompt_tokens if prompt_tokens is not None else self.tokens} prompt tokens"
        if not self.asked:
            return "K=auto long warm request not sent (DEPTH_WARM_WORDS=0)"
        if not self.words:
            return (f"K=auto long warm request not sent: max_model_len {self.mml} is too short "
                    f"for a long-context decision (no prompt longer than the short warm "
                    f"request's fits with {WARM_MAX_TOKENS} completion tokens); the depth policy "
                    "was checked at the short warm request's context only")
        if self.cut:
            return (f"K=auto long warm request cut to {self.words} of the {self.asked} words "
                    f"asked ({served}): max_model_len {self.mml} holds no more with "
                    f"{WARM_MAX_TOKENS} completion tokens (counted with {self.counted}); the "
                    "long-context decision is checked at that context only")
        return f"K=auto long warm request: {self.words} words ({served})"


def size_long_warm(asked: int, mml: int | None, count, floor: int = 0,
                   counted: str = "the checkpoint's tokenizer") -> LongWarm:
    """The most words of long_warm_prompt, up to ``asked``, whose chat (``count``: prompt tokens)
    leaves WARM_MAX_TOKENS completion tokens and LONG_WARM_SLACK free in ``mml`` (None: no
    limit known). Words whose prompt is no longer than ``floor`` tokens (the short warm
    request's context) decide nothing new: then none are sent."""
    if asked <= 0:
        return LongWarm(0, 0, 0, mml, counted)
    tokens = count(long_warm_prompt(asked))
    if mml is None or tokens + WARM_MAX_TOKENS + LONG_WARM_SLACK <= mml:
        return LongWarm(asked, asked, tokens, mml, counted)
    budget = mml - WARM_MAX_TOKENS - LONG_WARM_SLACK
    lo, hi, lo_tokens = 0, asked, None  # count(lo words) fits (or lo == 0), count(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        mid_tokens = count(long_warm_prompt(mid))
        if mid_tokens <= budget:
            lo, lo_tokens = mid, mid_tokens
        else:
            hi = mid
    if lo_tokens is None or lo_tokens <= floor:
        return LongWarm(asked, 0, 0, mml, counted)
    return LongWarm(asked, lo, lo_tokens, mml, counted)


def served_max_model_len(launch: Launch) -> int | None:
    """max_model_len as the server reports it on /v1/models; the launcher's MML when it does not."""
    try:
        status, body = _request(launch, "/v1/models", timeout=10)
        if status == 200:
            return int(json.loads(body)["data"][0]["max_model_len"])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        pass
    return launch.mml


def auto_depth_warm(launch: Launch, model: str, short: dict) -> tuple[dict, boot_gates.AutoDepth]:
    """K=auto: the long warm request, and the depths the policy picks (from its prior) for the
    two warm contexts, which the served_depth gate checks the engine drafted. The long request is
    DEPTH_WARM_WORDS words (LONG_WARM_WORDS), cut to what the served max_model_len holds (counted
    with the checkpoint's tokenizer and chat template; without them here, bounded by one token
    per byte over the short request's prompt), or not sent where nothing longer than the short
    request fits. The reply's ``note`` says which."""
    words = _int_setting(launch.environ, "DEPTH_WARM_WORDS", LONG_WARM_WORDS)
    mml = served_max_model_len(launch)
    floor = int(short.get("prompt_tokens", 0)) + int(short.get("completion_tokens", 0))
    count, why = chat_token_counter(launch.ckpt)
    counted = "the checkpoint's tokenizer"
    if count is None:
        # no tokenizer here: a byte-level BPE never needs more tokens than UTF-8 bytes, and the
        # short request's prompt holds the chat template's tokens
        def count(text: str, base: int = int(short.get("prompt_tokens", 0))) -> int:
            return base + len(text.encode())

        counted = f"one token per byte (no tokenizer here: {why})"
        warn(f"K=auto: the long warm request is sized by {counted}")
    plan = size_long_warm(words, mml, count, floor=floor, counted=counted)
    if plan.words:
        long = warm_request(launch, model, long_warm_prompt(plan.words))
        note = plan.note(long.get("prompt_tokens") if long.get("ok") else None)
    else:
        long, note = dict(short), plan.note()
    long["note"] = note
    policy = launch.depth

    def pick(reply: dict) -> tuple[int, int]:
        context = int(reply.get("prompt_tokens", 0)) + int(reply.get("completion_tokens", 0))
        return context, policy.decide(context).k

    return long, boot_gates.AutoDepth(policy.ladder, pick(short), pick(long))


def with_long_warm(warm: dict, long: dict) -> dict:
    """The warm_request gate's input under K=auto: the short reply with the long request's note,
    or the long request's failure."""
    if not long.get("ok"):
        return {**long, "error": f"the long warm request: {long.get('error')} ({long.get('note')})"}
    return {**warm, "note": long.get("note")}


def read_metrics(launch: Launch) -> str | None:
    try:
        status, body = _request(launch, "/metrics", timeout=10)
    except OSError:
        return None
    return body.decode(errors="replace") if status == 200 else None


def read_census(launch: Launch, settle_s: float = 15.0) -> dict | None:
    """The aggregated census once it shows the warm request's route calls (each rank flushes
    at most once a second), or whatever is there when ``settle_s`` runs out."""
    try:
        from qpn.fork_patches.route_census.census import aggregate
    except ImportError as exc:
        warn(f"cannot import the census reader qpn.fork_patches.route_census.census ({exc}): the overlay is "
             "missing from this checkout, so every census gate fails")
        return None
    deadline = time.monotonic() + settle_s
    while True:
        try:
            census, error = aggregate(launch.census_dir), None
        except (OSError, ValueError) as exc:
            census, error = None, exc
        if census and boot_gates.total_calls(census.get("route_counts", {})) > 0:
            # one more flush period, so every rank's post-request counts are in
            time.sleep(1.2)
            return aggregate(launch.census_dir)
        if time.monotonic() >= deadline:
            if error is not None:
                warn(f"census unreadable: {error}")
            return census
        time.sleep(0.5)


def run_gates(server: Server) -> list[boot_gates.GateResult]:
    launch = server.launch
    progress = BootProgress(launch)
    model = wait_for_models(server, progress)
    progress.tick(force=True, phase="warm request (one greedy chat, 8 tokens)")
    warm = warm_request(launch, model)
    auto = None
    if launch.depth and warm.get("ok"):
        progress.tick(force=True, phase="K=auto: a long warm request")
        long, auto = auto_depth_warm(launch, model, warm)
        warm = with_long_warm(warm, long)
    census = read_census(launch)
    metrics = read_metrics(launch)
    quant_cfg = quant_config(launch.ckpt, serve_preflight.load_checkpoint_config(launch.ckpt))
    quantized_layers = boot_gates.declared_layers(quant_cfg)
    convention, declared = boot_gates.declared_modules(launch.ckpt)  # any convention: what it needs
    from qpn.fork_patches.quant.conventions import MODELOPT

    # ModelOpt's coverage pairs by position in quantized_layers; every other convention's by name,
    # through the census's checkpoint_modules
    by_name = convention is not None and convention is not MODELOPT
    env = server_env(launch)
    from qpn.fork_patches.quant.qpn_config import claim_verdict

    qpn_claim, not_claimed = claim_verdict(quant_cfg, env)  # what the server's QPN config decides
    return boot_gates.evaluate(launch.profile, launch.k, warm, metrics, census, launch.regions,
                               tp=launch.tp or 1, quantized_layers=quantized_layers,
                               env=env, declared=declared,
                               checkpoint_modules=declared if by_name else None, auto_depth=auto,
                               qpn_claim=qpn_claim, qpn_not_claimed=not_claimed)


# ---- after READY: the engine's health ---------------------------------------------------------

HEALTH_PERIOD_S = 2.0
HEALTH_SILENCE_S = 60.0  # no answer from /health for this long counts as a dead server
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt))(?::|$)")
_ENGINE_PROCS = ("EngineCore", "Worker", "VllmWorker")
# vLLM's log line: "(EngineCore pid=7) ERROR 11-30 15:35:53 [core.py:1512] message"; the process tag
# is absent where one process logs alone.
_VLLM_LINE = re.compile(r"^(?:\((?P<proc>[^)]*)\)\s+)?(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL)"
                        r"\s+\d\d-\d\d\s+[\d:.]+\s+\[[^\]]*\]\s?(?P<msg>.*)$")
# What a process printed itself (a traceback on stderr), behind vLLM's process tag
_TAGGED_LINE = re.compile(r"^\((?P<proc>[^)]*)\)\s(?P<msg>.*)$")
# Lines that are never an error: other log levels (vLLM's, uvicorn's "INFO:", glog's "W1206 ..."
# of torch) and Python's warnings ("...: FutureWarning: ...")
_NOT_AN_ERROR = re.compile(r"^(?:DEBUG|INFO|WARNING|WARN)\b|^\[?[IWD]\d{4} \d\d:\d\d|"
                           r"\b[A-Z]\w*Warning: ")
# The API process's word that the engine core is gone (vLLM 0.32: core_client.py, async_llm.py)
_ENGINE_DIED = re.compile(r"engine core exited unexpectedly|EngineDeadError|"
                          r"Engine core proc \S+ died")


def watch_engine(server: Server, period_s: float = HEALTH_PERIOD_S,
                 silence_s: float = HEALTH_SILENCE_S) -> str:
    """Poll the engine core's health until it fails; return why. ``/health`` is vLLM's engine
    health (entrypoints/serve/instrumentator/health.py answers 503 once the engine core is dead,
    EngineDeadError); ``/v1/models`` is not: the API process answers it from its own state for as
    long as it lives, also with a dead engine."""
    launch = server.launch
    last_answer = time.monotonic()
    while True:
        if not server.alive():
            return (f"the server process exited on its own (exit {server.proc.returncode}); "
                    "nobody asked it to stop")
        try:
            status, _ = _request(launch, "/health", timeout=5)
        except OSError:
            status = None
        now = time.monotonic()
        if status == 200:
            last_answer = now
        elif status is not None and status >= 500:
            return f"the engine core is dead: /health answered {status}"
        elif now - last_answer > silence_s:
            return f"/health has not answered for {now - last_answer:.0f} s"
        time.sleep(period_s)


def _log_line(line: str) -> tuple[str | None, str | None, str]:
    """(process tag, level, message) of a server log line; level None for a line a process printed
    itself, "INFO" for any line that is no error (another level, a Python warning)."""
    text = line.strip()
    if m := _VLLM_LINE.match(text):
        return m["proc"], m["level"], m["msg"]
    proc, msg = None, text
    if m := _TAGGED_LINE.match(text):
        proc, msg = m["proc"], m["msg"]
    return proc, ("INFO" if _NOT_AN_ERROR.search(msg) else None), msg


def _first_error(run: list[tuple[str, str | None, str]]) -> str | None:
    """The first error of a run of (line, level, message): the exception line that ends its first
    traceback, or its first ERROR line that is neither a traceback nor the message a traceback
    follows (logger.exception's "EngineCore encountered a fatal error."), e.g. "Worker proc ...
    died unexpectedly (exit code: -9)". A printed line counts only inside a traceback or as an
    exception line."""
    in_traceback = False
    for i, (line, level, msg) in enumerate(run):
        text = msg.rstrip()
        if text.startswith("Traceback (most recent call last)"):
            in_traceback = True
            continue
        if in_traceback:
            if not text or text[0].isspace() or text.startswith(("During handling", "The above")):
                continue
            return line
        if level is None:
            if _EXCEPTION_LINE.match(text):
                return line
            continue
        following = run[i + 1][2] if i + 1 < len(run) else ""
        if following.startswith("Traceback (most recent call last)"):
            continue
        return line
    return None


def failure_summary(log_text: str, max_lines: int = 12) -> tuple[str | None, str]:
    """(the root error line, the last error lines) of a server log. Never a WARNING (vLLM's ulimit
    warning names an OSError, and is no failure).

    The root error is the first error of the failing engine process (EngineCore, Worker) in its
    last run of error lines: the exception that ends its first traceback, or an error line such
    as the engine core's "Worker proc ... died unexpectedly (exit code: -9)"; not an earlier error
    it survived (a request's error is followed by the engine's ordinary log lines). Where the
    engine core died without an error of its own (killed by a signal) and the API process says it
    is gone, the root error says that, naming the engine process. Otherwise the first error of the
    log's last run of error lines. The API process's EngineDeadError only repeats that the engine
    is gone."""
    lines = log_text.splitlines()
    parsed = [_log_line(line) for line in lines]
    runs: list[tuple[list, int | None]] = []  # (run, index of the ordinary line that closed it)
    run: list = []
    engine = died = None  # the last engine process tag; the line where the API saw it die
    for i, (line, (proc, level, msg)) in enumerate(zip(lines, parsed)):
        if proc is None or not proc.startswith(_ENGINE_PROCS):
            if _ENGINE_DIED.search(line):
                died = i
            continue
        if proc.startswith("EngineCore"):
            engine = proc
        if level in ("DEBUG", "INFO", "WARNING"):
            if run:  # the engine went on logging: what came before did not kill it
                runs.append((run, i))
                run = []
            continue
        run.append((line.strip(), level, msg))
    if run:
        runs.append((run, None))
    cause = None
    for run, closed in reversed(runs):
        if cause := _first_error(run):
            if closed is None or died is None or died < closed:
                break
            cause = None  # an error the engine survived; it died later, silently
            break
    if cause is None and died is not None and engine is not None:
        cause = (f"({engine}) logged no error before it died: killed by a signal (SIGKILL from "
                 "outside, or the kernel's out-of-memory killer: dmesg tells which)")
    if cause is None:
        run, runs = [], []
        for line, (proc, level, msg) in zip(lines, parsed):
            if "EngineDeadError" in line:
                continue
            if level in ("DEBUG", "INFO", "WARNING"):
                if run:
                    runs.append(run)
                    run = []
                continue
            run.append((line.strip(), level, msg))
        runs.append(run)
        cause = next((c for r in reversed(runs) if (c := _first_error(r))), None)
    errors: list[str] = []
    for line, (_, level, _) in zip(lines, parsed):
        if level not in ("DEBUG", "INFO", "WARNING") and re.search(
                r"\bERROR\b|Error|Exception|Traceback|died", line):
            text = line.strip()[:300]
            if not errors or errors[-1] != text:
                errors.append(text)
    return cause, "\n".join(errors[-max_lines:])


def report_engine_failure(server: Server, reason: str) -> None:
    try:
        with open(server.launch.server_log, errors="replace") as f:
            text = f.read()
    except OSError:
        text = ""
    cause, errors = failure_summary(text)
    print(f"[serve] ENGINE FAILED after READY: {reason}", file=sys.stderr, flush=True)
    if cause:
        print(f"[serve] root error: {cause}", file=sys.stderr, flush=True)
    print(f"[serve] last error lines of {server.launch.server_log}:\n"
          f"{errors or server.log_tail(20)}", file=sys.stderr, flush=True)


def announce(launch: Launch) -> None:
    p = launch.profile
    log(f"engine {p.name}: {p.description}; {p.distribution} {launch.engine_version} "
        f"({launch.python})")
    log(f"checkpoint {launch.ckpt}")
    if launch.depth:
        log(f"K=auto over depths {list(launch.depth.ladder)}: each step drafts the depth the "
            "policy picks for the longest live context (fork_patches/spec/depth_policy.py); "
            f"prior worth {launch.depth.prior_rounds:g} rounds"
            + ("; the verify batch keeps the deepest depth's width every round (this engine "
               "shortens only the drafter loop)" if launch.depth.fixed_verify else ""))
    log(f"K={launch.k} ({'speculation off' if launch.k == 0 else 'native MTP, greedy drafting'})"
        f", MNS={launch.mns}, MML={launch.mml or 'model default'}, TP={launch.tp or 1}, "
        f"GMU={launch.gmu if launch.gmu is not None else 'n/a on this engine'}")
    if launch.capture is None:
        log("capture sizes: engine default (CAPTURE=none)")
    else:
        note = "" if p.uses_cuda_graphs else " (not passed: this engine runs eagerly)"
        log(f"capture sizes: {launch.capture} -- covers N*(K+1) for N=1..{launch.mns}{note}")
    log(f"API: reasoning parser qwen3 (thinking {'on' if launch.thinking else 'off'} by "
        "default, per request via chat_template_kwargs.enable_thinking); tool calling "
        + (f"on (parser {launch.tool_parser})" if launch.tool_parser else
           "off (the chat template has no tool-call format)")
        + "; structured output on")
    if launch.api_key:
        log("API key required on every route but the probes /health, /ping, /metrics, /version, "
            "/load, /ready, /readyz (VLLM_API_KEY; the request policy, docs/serving.md)")
    if not serve_preflight.is_loopback(launch.host):
        warn(f"binding {launch.host} with no real authentication: keep it behind a firewall")
    log(f"run directory {launch.run_dir} (server log, census, gate table)")


def main(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    environ = dict(os.environ if environ is None else environ)
    try:
        launch = prepare(argv, environ)
    except Refusal as exc:
        print(f"[serve] REFUSED: {exc}", file=sys.stderr, flush=True)
        return 2
    warning = serve_preflight.revision_warning(launch.ckpt)
    if warning:
        warn(warning)
    announce(launch)

    def on_signal(signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server = Server(launch)
    ready = False
    try:
        log("starting the engine: " + " ".join(server_command(launch)[1:]))
        server.start()
        log(f"server pid {server.proc.pid}; waiting for /v1/models")
        results = run_gates(server)
        table = boot_gates.format_table(results)
        failed = [r for r in results if r.failed]
        with open(launch.gates_json, "w") as f:
            f.write(boot_gates.to_json(
                results, engine=launch.profile.name, engine_version=launch.engine_version,
                k=launch.k, mns=launch.mns, capture_sizes=launch.capture, checkpoint=launch.ckpt,
                census_dir=launch.census_dir, time=time.strftime("%Y-%m-%dT%H:%M:%S%z")))
        print(table, flush=True)
        log(f"gate table written to {launch.gates_json}")
        if failed:
            for r in failed:
                print(f"[serve] GATE FAILED: {r.name}: expected {r.expected}; observed "
                      f"{r.observed}", file=sys.stderr, flush=True)
            print("[serve] BOOT GATES FAILED: this server is not the configuration asked for; "
                  "stopping it", file=sys.stderr, flush=True)
            return 1
        ready = True
        log(f"READY url={launch.root_url}/v1 model={launch.served_name} pid={server.proc.pid} "
            f"gates={launch.gates_json} -- stop with Ctrl-C here, or kill -TERM {os.getpid()}; "
            f"server log {launch.server_log}")
        report_engine_failure(server, watch_engine(server))
        return 1
    except BootFailure as exc:
        print(f"[serve] BOOT FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        log("stop requested" + ("" if ready else " before the gates passed"))
        return 0 if ready else 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
