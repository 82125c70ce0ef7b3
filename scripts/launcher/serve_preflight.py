"""Checks the launcher makes before any engine process starts.

Each check either returns what it learned or raises ``Refusal`` with a message that names the
problem and the fix. A warning (a checkpoint that is not the pinned revision) is returned, not
raised: serving it is legitimate, quoting its figures next to the published ones is not.
"""
from __future__ import annotations

import errno
import ipaddress
import json
import os
import shutil
import socket
import struct
import subprocess
from pathlib import Path

# The checkpoint the seed's figures describe (seed 000, Quick start): any other revision is a
# different set of weights.
PINNED_REPO = "RadixArk/Qwen3.8-27B-NVFP4"
PINNED_REVISION = "554ebba9b5f1b79dc11246341960360e6ef05ef4"

# Deepest speculation we serve. vLLM reuses a single MTP layer recursively for any depth, so the
# head itself sets no ceiling; ours is the verification width. Each round verifies K+1 rows per
# sequence, and the QPN decode kernels tile 8 rows at a time with a two-tile (M <= 16) variant:
# past K=15 verification leaves the packed decode bands (the route table, kernels/routes.py).
MAX_DEPTH = 15

UNAUTHENTICATED_ACK = "I_UNDERSTAND_THIS_IS_UNAUTHENTICATED"


class Refusal(RuntimeError):
    """The launcher will not start the engine; the message says why and what to do."""


# ---- network ---------------------------------------------------------------------------------

def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost: resolve-dependent, treat as public


def check_bind(host: str, environ: dict[str, str]) -> None:
    if is_loopback(host):
        return
    if environ.get(UNAUTHENTICATED_ACK) == "1":
        return
    raise Refusal(
        f"refusing to bind HOST={host}: the server has no authentication (VLLM_API_KEY does not "
        "guard every endpoint). Keep the default HOST=127.0.0.1 and reach it from another "
        "machine through an SSH tunnel:  ssh -N -L 8000:127.0.0.1:8000 you@this-box\n"
        f"  To expose it anyway, on a firewalled network:  HOST={host} "
        f"{UNAUTHENTICATED_ACK}=1 bash scripts/serve-qwen38-native.sh CKPT")


def check_port(host: str, port: int) -> None:
    if not 0 < port < 65536:
        raise Refusal(f"PORT={port} is not a TCP port (1-65535)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # The server sets SO_REUSEADDR too, so a socket in TIME_WAIT is not "taken".
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host.strip("[]"), port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise Refusal(
                    f"port {port} on {host} is already in use (another server, or a previous "
                    f"one still shutting down). Stop it, or choose another: PORT=<free port>"
                ) from None
            raise Refusal(f"cannot bind {host}:{port}: {exc.strerror}. Check HOST and PORT"
                          ) from None


# ---- checkpoint ------------------------------------------------------------------------------

def load_checkpoint_config(ckpt: str | None) -> dict:
    if not ckpt:
        raise Refusal("no checkpoint given. Usage: bash scripts/serve-qwen38-native.sh CKPT_DIR")
    if not os.path.isdir(ckpt):
        raise Refusal(f"checkpoint {ckpt} does not exist (or is not a directory). Download it:"
                      f"  hf download {PINNED_REPO} --revision {PINNED_REVISION} "
                      "--local-dir ./Qwen3.8-27B-NVFP4")
    path = os.path.join(ckpt, "config.json")
    if not os.path.isfile(path):
        raise Refusal(f"{ckpt} has no config.json: not a Hugging Face checkpoint directory. "
                      "Point CKPT at the folder that holds config.json and the safetensors")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise Refusal(f"{path} is unreadable or not JSON ({exc}); re-download the checkpoint"
                      ) from None


def checkpoint_revision(ckpt: str) -> tuple[str | None, str]:
    """(revision, where it was read). `hf download --local-dir` records the commit of every
    file it fetched in .cache/huggingface/download/<file>.metadata (first line); a REVISION file
    (one line, the commit) serves checkpoints copied by other means."""
    meta = os.path.join(ckpt, ".cache", "huggingface", "download", "config.json.metadata")
    for path in (meta, os.path.join(ckpt, "REVISION")):
        try:
            with open(path) as f:
                first = f.readline().strip()
        except OSError:
            continue
        if first:
            return first, os.path.relpath(path, ckpt)
    return None, "no .cache/huggingface download metadata and no REVISION file"


def revision_warning(ckpt: str) -> str | None:
    revision, source = checkpoint_revision(ckpt)
    if revision == PINNED_REVISION:
        return None
    found = f"revision {revision} ({source})" if revision else f"unknown revision ({source})"
    return (f"checkpoint {ckpt}: {found}, not the pinned {PINNED_REPO}@{PINNED_REVISION}. "
            "It serves, but its figures are not comparable with the published ones")


def text_config(config: dict) -> dict:
    """The language-model part of a config (multimodal Qwen3.5 configs nest it)."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


def mtp_layers(config: dict) -> int:
    cfg = text_config(config)
    for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        value = cfg.get(key, config.get(key))
        if value is not None:
            return int(value)
    return 0


def _safetensors_keys(path: str) -> list[str]:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return [k for k in header if k != "__metadata__"]


def checkpoint_has_mtp_weights(ckpt: str) -> bool | None:
    """True/False from the safetensors index or headers; None when there are no safetensors."""
    index = os.path.join(ckpt, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            keys = list(json.load(f).get("weight_map", {}))
    else:
        files = [n for n in os.listdir(ckpt) if n.endswith(".safetensors")]
        if not files:
            return None
        keys = [k for n in files for k in _safetensors_keys(os.path.join(ckpt, n))]
    return any(k.startswith("mtp.") or ".mtp." in k for k in keys)


def check_depth(k: int, config: dict, ckpt: str) -> None:
    """K against the MTP head. vLLM's MTP proposer runs the checkpoint's n MTP layers in turn
    and, for K > n, cycles through them again, which it allows only when n divides K
    (config/speculative.py); a single-layer head (Qwen3.5's) therefore serves any K."""
    if k < 0:
        raise Refusal(f"K={k}: speculative depth is 0 (off) or a positive number of draft tokens")
    if k == 0:
        return
    if k > MAX_DEPTH:
        raise Refusal(f"K={k} is deeper than {MAX_DEPTH}: verification would be {k + 1} rows per "
                      "sequence, past the packed QPN decode bands. Use a depth profile "
                      "(K=7 general, K=3 long context, K=15 extraction) or K=0 to turn "
                      "speculation off")
    layers = mtp_layers(config)
    if layers < 1:
        raise Refusal(f"K={k} asks for MTP speculation but {ckpt}/config.json declares no MTP "
                      "layers (mtp_num_hidden_layers / num_nextn_predict_layers). Serve it with "
                      "K=0")
    if k > layers and k % layers:
        raise Refusal(f"K={k}: this checkpoint's MTP head has {layers} layers and vLLM reuses "
                      f"them in whole passes, so K must be at most {layers} or a multiple of it")
    if checkpoint_has_mtp_weights(ckpt) is False:
        raise Refusal(f"K={k}: config.json declares {layers} MTP layer(s) but no mtp.* tensors "
                      "are in the safetensors (a checkpoint exported without its MTP head). "
                      "Serve it with K=0, or use a checkpoint that ships the head")


# ---- GPUs ------------------------------------------------------------------------------------

def gpu_holders(nvidia_smi: str = "nvidia-smi", visible: str | None = None) -> list[str] | None:
    """Processes holding the (visible) GPUs, one line each; None when nvidia-smi is absent."""
    exe = shutil.which(nvidia_smi)
    if exe is None:
        return None
    gpus = subprocess.run([exe, "--query-gpu=index,uuid", "--format=csv,noheader"],
                          capture_output=True, text=True, timeout=30, check=True).stdout
    uuid_to_index = {}
    for line in gpus.splitlines():
        if line.strip():
            index, uuid = (part.strip() for part in line.split(",", 1))
            uuid_to_index[uuid] = index
    wanted = None
    if visible:
        wanted = {v.strip() for v in visible.split(",") if v.strip()}
    apps = subprocess.run(
        [exe, "--query-compute-apps=gpu_uuid,pid,process_name,used_memory",
         "--format=csv,noheader"], capture_output=True, text=True, timeout=30, check=True).stdout
    holders = []
    for line in apps.splitlines():
        if not line.strip():
            continue
        uuid, pid, name, mem = (part.strip() for part in line.split(",", 3))
        index = uuid_to_index.get(uuid, "?")
        if wanted is not None and index not in wanted and uuid not in wanted:
            continue
        holders.append(f"GPU {index}: pid {pid} {name} ({mem})")
    return holders


def check_gpus_free(nvidia_smi: str = "nvidia-smi", visible: str | None = None) -> str:
    holders = gpu_holders(nvidia_smi, visible)
    if holders is None:
        raise Refusal(f"{nvidia_smi} not found: cannot confirm the GPUs are free. Install the "
                      "NVIDIA driver utilities, or use the cpu engine (ENGINE=cpu)")
    if holders:
        raise Refusal("GPUs already in use; a server booted beside these runs at a fraction of "
                      "its speed instead of failing. Stop them first (or pick free GPUs with "
                      "CUDA_VISIBLE_DEVICES):\n  " + "\n  ".join(holders))
    return "free"


def check_checkpoint_tensors(ckpt: str, environ=None) -> str:
    """Refuse an integer checkpoint (AutoAWQ, GPTQ, compressed-tensors pack-quantized:
    qpn.fork_patches.quant.conventions.integer_convention_of) that is not whole, before any engine
    starts: a truncated or corrupt safetensors file, a config QPN's integer families do not serve
    (bits, group size), a declared module whose codes, scales or zero points are missing or of the
    wrong dtype or shape, an activation-ordered g_idx (conventions.integer_checkpoint_problems).
    Every line names the module. Other checkpoints pass untouched (their modules are checked by the
    loader). ``environ``: where the families' switches (``QPN_INT4``, ``QPN_INT8``) are read
    (default os.environ); a value that is not a switch is refused."""
    from qpn.fork_patches.quant import conventions

    try:
        q = json.loads((Path(ckpt) / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return "no integer checkpoint"
    convention = conventions.integer_convention_of(q)
    if convention is None:
        return "no integer checkpoint"
    try:
        schemes = (list(conventions.integer_group_schemes(q).values()) if convention.declared_by == "config_groups"
                   else [convention.scheme(q)])
    except conventions.ConventionError:
        schemes = []  # a config QPN does not serve: integer_checkpoint_problems names it
    title = " / ".join(dict.fromkeys(s.format.title for s in schemes)) or "integer"
    # Where QPN does not claim the family (its QPN_<FAMILY>=0, or the family not ready:
    # qpn_config.family_ready) the engine's own kernels serve these checkpoints: only damage (a
    # truncated or corrupt file) is refused then, not what QPN's family would not serve.
    ours, why = True, ""
    try:
        from qpn.fork_patches.quant.qpn_config import NotServed, family_served
    except ImportError as exc:
        ours, why = False, f"qpn_config does not import here ({exc})"
    else:
        for fmt in dict.fromkeys(s.format for s in schemes):
            try:
                ok, reason = family_served(fmt, environ)
            except NotServed as exc:
                raise Refusal(str(exc)) from None
            if not ok:
                ours, why = False, reason
    try:
        problems = (conventions.integer_checkpoint_problems(ckpt) if ours
                    else conventions.safetensors_problems(ckpt))
    except (OSError, ValueError) as exc:
        problems = [f"cannot read the checkpoint's tensors: {exc}"]
    if problems:
        more = f"\n  (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise Refusal(f"{ckpt} ({convention.name} {title}) cannot be served as stored:\n  "
                      + "\n  ".join(problems[:8]) + more
                      + f"\nRe-download the checkpoint (a truncated or corrupt file), or re-export it without "
                        f"what the {title} family does not serve")
    return f"{convention.name} {title} tensors whole" + ("" if ours else f"; left to the engine's kernels ({why})")


def check_tp_split(ckpt: str, tp: int | None, environ=None) -> str:
    """Refuse a checkpoint whose quantized modules cannot be split over ``tp`` ranks with whole
    NVFP4 groups and whole k-blocks per rank (qpn.fork_patches.quant.tp_sharding), naming the module.
    The modules are those the checkpoint's convention declares (boot_gates.declared_modules:
    every convention alike). First, at any TP, an integer checkpoint's tensors must be whole
    (``check_checkpoint_tensors``, ``environ`` its families' switches): the split is planned from
    the same headers."""
    check_checkpoint_tensors(ckpt, environ)
    if not tp or tp <= 1:
        return "single rank"
    from qpn.fork_patches.quant.tp_sharding import checkpoint_modules, plan
    from qpn.scripts.launcher.boot_gates import declared_modules

    from qpn.fork_patches.quant.conventions import ConventionError

    try:
        convention, declared = declared_modules(ckpt)
    except ConventionError as exc:  # a scheme QPN does not serve: the loader would refuse it too
        raise Refusal(f"TP={tp}: cannot plan the split of {ckpt}: {exc}. Fix the checkpoint's "
                      "quantization config, or serve it on hardware vLLM supports natively") from None
    modules = checkpoint_modules(ckpt, declared, convention)
    _, issues = plan(modules, tp)
    if issues:
        more = f" (and {len(issues) - 5} more)" if len(issues) > 5 else ""
        raise Refusal(f"TP={tp}: this checkpoint cannot be split over {tp} ranks:\n  "
                      + "\n  ".join(issues[:5]) + more
                      + "\nChoose a TP that divides these sizes (e.g. TP=1, 2 or 4 for Qwen3.8-27B)")
    return f"{len(modules)} quantized module(s) split over {tp} ranks"
