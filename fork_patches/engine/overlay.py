"""The on-disk overlay of an installed engine: apply, check, restore. Crash-safe and reversible.

Runs inside the engine's virtualenv (``python -m qpn.fork_patches.engine.overlay apply|check|restore
--engine cpu``) and never imports vLLM for its work on disk, so it works on a broken engine too.

Guarantees:
- an engine file is changed only by an atomic rename (it is pristine or patched, never torn);
- the pristine copy is kept as ``<file>.pre_bootstrap``, created from a file whose hash equals the
  wheel's RECORD, and an existing backup is never overwritten;
- patches are computed from the backup, so running twice gives the same bytes;
- a journal is written before the first change and removed after the manifest: a run killed in
  between leaves the journal, ``check`` reports the engine as not good, and the next ``apply``
  rolls the files back to pristine and applies again;
- ``restore`` returns every engine file to its RECORD hash and verifies all of them.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from qpn.fork_patches.engine import engine_lock
from qpn.fork_patches.engine.engine_lock import load_lock  # noqa: F401 - re-exported
from qpn.fork_patches.engine.hooks import AnchorMissing, hooks_for

STATE_DIR_NAME = "volta_qpn_overlay"
BACKUP_SUFFIX = ".pre_bootstrap"
OUR_DISTRIBUTION = "volta-qpn"
PLUGIN_GROUP = "vllm.general_plugins"
# Test aid: QPN_OVERLAY_FAULT=<point> kills the process at that point, as a crash would.
FAULT_ENV = "QPN_OVERLAY_FAULT"


class OverlayError(RuntimeError):
    pass


def _say(msg: str) -> None:
    print(f"[overlay] {msg}", flush=True)


def _fault(point: str) -> None:
    if os.environ.get(FAULT_ENV) == point:
        _say(f"fault injected at {point}: exiting as if killed")
        os._exit(137)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def record_digest(hex_digest: str) -> str:
    """The form RECORD files use: urlsafe base64 of the raw digest, no padding."""
    return base64.urlsafe_b64encode(bytes.fromhex(hex_digest)).rstrip(b"=").decode()


def _atomic_write_bytes(target: Path, data: bytes, mode_from: Path | None = None) -> None:
    tmp = target.with_name(target.name + ".qpn-tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if mode_from is not None and mode_from.exists():
        shutil.copymode(mode_from, tmp)
    os.replace(tmp, target)


def _atomic_copy(src: Path, dst: Path) -> None:
    _atomic_write_bytes(dst, src.read_bytes(), mode_from=src)


def _write_json(path: Path, obj) -> None:
    _atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


# ---------------------------------------------------------------- the engine and its lock


@dataclass
class Engine:
    name: str
    version: str
    site_packages: Path
    vllm_dir: Path
    record: dict[str, str]  # path relative to site-packages -> RECORD digest (sha256, b64)

    @property
    def state_dir(self) -> Path:
        return self.site_packages / STATE_DIR_NAME


def find_engine() -> Engine:
    """The installed distribution that owns ``vllm/__init__.py`` (not our metadata shim)."""
    for dist in metadata.distributions():
        files = dist.files or []
        if not any(str(f) == "vllm/__init__.py" for f in files):
            continue
        record = {}
        for f in files:
            if f.hash is not None and f.hash.mode == "sha256":
                record[str(f)] = f.hash.value
        site_packages = Path(dist.locate_file("")).resolve()
        return Engine(
            name=dist.metadata["Name"].lower(),
            version=dist.version,
            site_packages=site_packages,
            vllm_dir=site_packages / "vllm",
            record=record,
        )
    raise OverlayError(
        "no installed vLLM engine found in this environment (no distribution owns "
        "vllm/__init__.py); run scripts/bootstrap-sm70.sh to install the pinned engine"
    )


def require_known(engine: Engine, profile_name: str, lock: dict) -> dict:
    """The locked profile (flat, at the installed version) of the engine found; OverlayError
    naming what was found when it is not a locked build of ``profile_name``."""
    if profile_name not in lock["engines"]:
        raise OverlayError(
            f"unknown engine profile {profile_name!r}; known: {', '.join(lock['engines'])}"
        )
    table = lock["engines"][profile_name]
    try:
        if engine.name != table["distribution"]:
            raise engine_lock.LockError("another distribution")
        return engine_lock.profile_for_installed(profile_name, engine.version, lock)
    except engine_lock.LockError:
        raise OverlayError(
            f"the overlay does not know engine {engine.name} {engine.version}: profile "
            f"{profile_name!r} is {table['distribution']} "
            f"{', '.join(engine_lock.versions(profile_name, lock))} (a local build suffix such as "
            "+cu128 is accepted). Install the pinned engine with scripts/bootstrap-sm70.sh (a fresh "
            "ENV_PREFIX), or port the hooks in fork_patches/engine/hooks.py to this version first"
        ) from None


# ---------------------------------------------------------------- the plan


def planned_files(engine_key: str) -> dict[str, list]:
    """Engine file -> the disk hooks that edit it, on ``engine_key`` (``cpu@0.32.0``) or a profile."""
    plan: dict[str, list] = {}
    for hook in hooks_for(engine_key, kind="disk"):
        plan.setdefault(hook.anchor_for(engine_key), []).append(hook)
    return plan


def patched_text(pristine: str, hooks: list, relpath: str, engine_key: str | None = None) -> str:
    text = pristine
    for hook in hooks:
        try:
            text = hook.load(engine_key)(text)
        except AnchorMissing as exc:
            raise OverlayError(
                f"hook {hook.name}: its anchor in vllm/{relpath} is missing ({exc}); this engine "
                "is not the version the hook was written for"
            ) from exc
    return text


def _shim_spec(profile: dict) -> tuple[str, str] | None:
    spec = profile.get("metadata_shim", "")
    if not spec:
        return None
    name, _, version = spec.partition("==")
    return name, version


def _shim_dir(engine: Engine, profile: dict) -> Path | None:
    spec = _shim_spec(profile)
    if spec is None:
        return None
    return engine.site_packages / f"{spec[0]}-{spec[1]}.dist-info"


def _write_shim(engine: Engine, profile: dict) -> None:
    name, version = _shim_spec(profile)
    target = _shim_dir(engine, profile)
    tmp = target.with_name(target.name + ".qpn-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    (tmp / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        f"Summary: metadata-only alias written by volta-qpn; the code is distribution "
        f"{profile['distribution']}\n"
    )
    (tmp / "INSTALLER").write_text("volta-qpn\n")
    rel = target.name
    (tmp / "RECORD").write_text(f"{rel}/METADATA,,\n{rel}/INSTALLER,,\n{rel}/RECORD,,\n")
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)


# ---------------------------------------------------------------- apply / rollback / restore


def _rollback(engine: Engine, journal_path: Path) -> None:
    journal = json.loads(journal_path.read_text())
    _say(f"found an interrupted overlay (started {journal.get('started')}): rolling back")
    for relpath in journal.get("files", []):
        target = engine.vllm_dir / relpath
        backup = target.with_name(target.name + BACKUP_SUFFIX)
        if backup.exists():
            _atomic_copy(backup, target)
            _say(f"  restored vllm/{relpath} from its backup")
    (engine.state_dir / "manifest.json").unlink(missing_ok=True)
    journal_path.unlink()


def apply(profile_name: str) -> int:
    lock = load_lock()
    engine = find_engine()
    profile = require_known(engine, profile_name, lock)
    engine.state_dir.mkdir(exist_ok=True)
    journal_path = engine.state_dir / "journal.json"
    manifest_path = engine.state_dir / "manifest.json"
    if journal_path.exists():
        _rollback(engine, journal_path)

    plan = planned_files(profile["key"])
    previous = json.loads(manifest_path.read_text())["files"] if manifest_path.exists() else {}
    stale = sorted(set(previous) - set(plan))
    _write_json(
        journal_path,
        {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": sorted(set(plan) | set(stale))},
    )
    _fault("after_journal")

    for relpath in stale:  # a hook we no longer ship: back to pristine
        target = engine.vllm_dir / relpath
        backup = target.with_name(target.name + BACKUP_SUFFIX)
        if backup.exists():
            _atomic_copy(backup, target)
            backup.unlink()
        _say(f"vllm/{relpath}: no longer patched, restored")

    files = {}
    changed = 0
    for relpath, hooks in sorted(plan.items()):
        target = engine.vllm_dir / relpath
        backup = target.with_name(target.name + BACKUP_SUFFIX)
        expected = engine.record.get(f"vllm/{relpath}")
        if expected is None:
            raise OverlayError(f"vllm/{relpath} is not in the engine's RECORD; cannot verify it")
        if backup.exists():
            if record_digest(sha256_file(backup)) != expected:
                raise OverlayError(
                    f"{backup} does not match the wheel's RECORD: the backup is not pristine. "
                    "Reinstall the engine into a fresh ENV_PREFIX"
                )
        else:
            if record_digest(sha256_file(target)) != expected:
                raise OverlayError(
                    f"{target} differs from the wheel's RECORD and has no backup: something else "
                    "changed it. Reinstall the engine into a fresh ENV_PREFIX"
                )
            _atomic_copy(target, backup)
            _fault("after_backup")
        pristine = backup.read_text()
        new_text = patched_text(pristine, hooks, relpath, profile["key"])
        if target.read_text() != new_text:
            _atomic_write_bytes(target, new_text.encode(), mode_from=backup)
            changed += 1
            _say(f"patched vllm/{relpath} ({', '.join(h.name for h in hooks)})")
            _fault("after_patch")
        else:
            _say(f"vllm/{relpath} already patched")
        files[relpath] = {
            "pristine_sha256": sha256_file(backup),
            "patched_sha256": sha256_file(target),
            "hooks": [h.name for h in hooks],
        }

    shim = _shim_dir(engine, profile)
    if shim is not None and not shim.exists():
        _write_shim(engine, profile)
        changed += 1
        _say(f"added metadata alias {shim.name}")
    _fault("before_manifest")
    manifest = {
        "engine": profile_name,
        "distribution": engine.name,
        "version": engine.version,
        "files": files,
        "added": [shim.name] if shim is not None else [],
    }
    if not manifest_path.exists() or json.loads(manifest_path.read_text()) != manifest:
        _write_json(manifest_path, manifest)
    journal_path.unlink()
    _say(f"overlay complete: {len(files)} engine file(s) patched, {changed} change(s) this run")
    return 0


def verify_record(engine: Engine) -> list[str]:
    """Every file of the engine distribution whose bytes differ from its RECORD hash."""
    bad = []
    for relpath, digest in sorted(engine.record.items()):
        path = engine.site_packages / relpath
        if not path.exists():
            bad.append(f"missing: {relpath}")
        elif record_digest(sha256_file(path)) != digest:
            bad.append(f"differs from RECORD: {relpath}")
    return bad


def restore(profile_name: str) -> int:
    engine = find_engine()
    lock = load_lock()
    profile = lock["engines"].get(profile_name, {})
    journal_path = engine.state_dir / "journal.json"
    if journal_path.exists():
        _rollback(engine, journal_path)
    restored = 0
    for backup in sorted(engine.vllm_dir.rglob("*" + BACKUP_SUFFIX)):
        target = backup.with_name(backup.name[: -len(BACKUP_SUFFIX)])
        _atomic_copy(backup, target)
        backup.unlink()
        restored += 1
        _say(f"restored vllm/{target.relative_to(engine.vllm_dir)}")
    shim = _shim_dir(engine, profile) if profile else None
    if shim is not None and shim.exists():
        shutil.rmtree(shim)
        _say(f"removed metadata alias {shim.name}")
    shutil.rmtree(engine.state_dir, ignore_errors=True)
    bad = verify_record(engine)
    if bad:
        for line in bad[:20]:
            _say(line)
        raise OverlayError(
            f"{len(bad)} engine file(s) do not match the wheel's RECORD after restore; "
            "reinstall the engine into a fresh ENV_PREFIX"
        )
    _say(
        f"restore complete: {restored} file(s) restored; all {len(engine.record)} hashed files "
        f"of {engine.name} {engine.version} match the wheel's RECORD"
    )
    return 0


# ---------------------------------------------------------------- check


def check(profile_name: str, source: Path | None = None) -> int:
    problems: list[str] = []
    lock = load_lock()
    engine = find_engine()
    profile = require_known(engine, profile_name, lock)
    _say(f"engine: {engine.name} {engine.version} at {engine.site_packages}")
    journal_path = engine.state_dir / "journal.json"
    manifest_path = engine.state_dir / "manifest.json"
    if journal_path.exists():
        problems.append("an overlay run was interrupted (journal present): run the bootstrap again")
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else None
    if manifest is None:
        problems.append("no overlay manifest: the overlay was never applied here")
        manifest = {"files": {}, "version": None}
    elif manifest.get("version") != engine.version or manifest.get("engine") != profile_name:
        problems.append(
            f"manifest is for {manifest.get('engine')} {manifest.get('version')}, "
            f"engine is {profile_name} {engine.version}"
        )
    for relpath, hooks in sorted(planned_files(profile["key"]).items()):
        entry = manifest["files"].get(relpath)
        target = engine.vllm_dir / relpath
        backup = target.with_name(target.name + BACKUP_SUFFIX)
        if entry is None:
            problems.append(f"vllm/{relpath}: not in the manifest")
            continue
        if sorted(entry["hooks"]) != sorted(h.name for h in hooks):
            problems.append(f"vllm/{relpath}: manifest hooks {entry['hooks']} are out of date")
        if sha256_file(target) != entry["patched_sha256"]:
            problems.append(f"vllm/{relpath}: does not match the manifest (changed since overlay)")
        if not backup.exists():
            problems.append(f"vllm/{relpath}: backup {backup.name} is missing")
        elif record_digest(sha256_file(backup)) != engine.record.get(f"vllm/{relpath}"):
            problems.append(f"vllm/{relpath}: backup does not match the wheel's RECORD")
        else:
            _say(f"ok  vllm/{relpath}: patched by {', '.join(entry['hooks'])}, backup pristine")
    shim = _shim_dir(engine, profile)
    if shim is not None:
        if shim.exists():
            _say(f"ok  metadata alias {shim.name}")
        else:
            problems.append(f"metadata alias {shim.name} is missing")
    problems.extend(_check_our_distribution(engine.site_packages, source))
    if not problems:  # only a complete overlay is worth importing the engine for
        problems.extend(_check_runtime_anchors(profile["key"]))
    if problems:
        for p in problems:
            _say(f"FAIL {p}")
        _say(f"overlay state: NOT GOOD ({len(problems)} problem(s))")
        return 1
    _say("overlay state: GOOD")
    return 0


# Installed package -> source folder (pyproject.toml's package-dir).
SOURCE_FOLDERS = {"qpn": "qpn", "qpn/fork_patches": "fork_patches",
                  **{f"qpn/fork_patches/{c}": f"fork_patches/{c}"
                     for c in ("quant", "spec", "api", "route_census", "engine")},
                  "qpn/kernels": "kernels",
                  "qpn/scripts": "scripts", "qpn/scripts/install": "scripts/install",
                  "qpn/scripts/launcher": "scripts/launcher", "qpn/scripts/checkpoints": "scripts/checkpoints",
                  "qpn/benchmarks": "benchmarks"}


def source_folders(source: Path) -> dict[str, str]:
    """SOURCE_FOLDERS plus every package folder of the checkout's kernels/ (the weight families,
    kernels/families/<name>/), found by walking it: a new family needs no entry here."""
    folders = dict(SOURCE_FOLDERS)
    for init in sorted((source / "kernels").rglob("__init__.py")):
        folder = init.parent.relative_to(source).as_posix()
        folders.setdefault(f"qpn/{folder}", folder)
    return folders


def _stale_against_source(dist, source: Path) -> list[str]:
    """Installed modules that differ from, or are missing against, the source checkout."""
    folders = source_folders(source)
    installed = {}
    for f in dist.files or []:
        parent, _, name = str(f).rpartition("/")
        if parent in folders and name.endswith(".py"):
            installed[(parent, name)] = Path(dist.locate_file(f))
    stale = []
    for package, folder in folders.items():
        for src in sorted((source / folder).glob("*.py")):
            path = installed.get((package, src.name))
            if path is None or not path.exists():
                stale.append(f"{folder}/{src.name} is not installed")
            elif sha256_file(path) != sha256_file(src):
                stale.append(f"{folder}/{src.name} differs from the installed copy")
    return stale


def _check_our_distribution(site_packages: Path, source: Path | None = None) -> list[str]:
    # Look in site-packages only: a build of the checkout leaves volta_qpn.egg-info in it, and
    # the working directory is on sys.path when the check runs from there.
    dists = list(metadata.distributions(name=OUR_DISTRIBUTION, path=[str(site_packages)]))
    if not dists:
        return [f"{OUR_DISTRIBUTION} is not installed in this environment"]
    dist = dists[0]
    problems = []
    if source is not None:
        stale = _stale_against_source(dist, source)
        if stale:
            problems.append(
                f"the installed {OUR_DISTRIBUTION} is older than the checkout {source} "
                f"({len(stale)} module(s), e.g. {stale[0]}): run the bootstrap again"
            )
    if not any(ep.group == PLUGIN_GROUP for ep in dist.entry_points):
        problems.append(f"{OUR_DISTRIBUTION} registers no {PLUGIN_GROUP} entry point")
    for f in dist.files or []:
        if f.hash is None or f.hash.mode != "sha256":
            continue
        path = Path(dist.locate_file(f))
        if not path.exists() or record_digest(sha256_file(path)) != f.hash.value:
            problems.append(f"{OUR_DISTRIBUTION}: installed file {f} differs from its RECORD")
    if not problems:
        _say(f"ok  {OUR_DISTRIBUTION} {dist.version} installed, plugin registered, files intact")
    return problems


def _check_runtime_anchors(engine_key: str) -> list[str]:
    """Every runtime hook's anchor exists in the installed engine (imports vLLM: seconds)."""
    from qpn.fork_patches.engine.plugin import check_anchor

    hooks = hooks_for(engine_key, kind="runtime")
    _say(f"importing the engine to check the anchors of {len(hooks)} runtime hook(s)")
    problems = []
    for hook in hooks:
        try:
            check_anchor(hook, engine_key)
        except AnchorMissing as exc:
            problems.append(str(exc))
        else:
            _say(f"ok  runtime hook {hook.name}: anchor {hook.anchor_for(engine_key)}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qpn.fork_patches.engine.overlay")
    parser.add_argument("action", choices=["apply", "check", "restore"])
    parser.add_argument("--engine", required=True, help="engine profile from engines.lock.toml")
    parser.add_argument("--source", type=Path, help="check: the checkout volta-qpn was installed from")
    args = parser.parse_args(argv)
    try:
        if args.action == "check":
            return check(args.engine, args.source)
        return {"apply": apply, "restore": restore}[args.action](args.engine)
    except OverlayError as exc:
        _say(f"ERROR: {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
