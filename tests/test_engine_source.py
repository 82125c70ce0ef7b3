"""Every hook and the QPN quantization method's registration path proven against every locked
engine's own source: the cpu engine's installed files and the 1Cat-vLLM 1.2.2 and 1.3.0 source
archives (../shared/engines, read in place), then our plugin registered against the real 1Cat
modules in a subprocess on the cpu engine's interpreter, where 1Cat's own ModelConfig settles each
convention's checkpoint on the registered QPN config ahead of its built-ins."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from qpn.fork_patches.engine import engine_lock, engine_source
from qpn.fork_patches.engine.hooks import REGISTRY, hooks_for
from tests._ci import onecat_archive

from tests._ci import REPO  # noqa: E402
VERSIONS = engine_lock.versions("sm70")
_archive = onecat_archive  # other test modules import it under this name


def _engine_site_packages() -> Path:
    py = os.environ.get("QPN_ENGINE_PYTHON", sys.executable)
    out = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    return Path(out)


def _cli(*args: str) -> subprocess.CompletedProcess:
    py = os.environ.get("QPN_ENGINE_PYTHON", sys.executable)
    return subprocess.run([py, "-m", "qpn.fork_patches.engine.engine_source", *args],
                          capture_output=True, text=True, timeout=600)


def test_the_lock_names_three_engines_and_defaults_sm70_to_1_3_0():
    assert sorted(engine_lock.engine_keys()) == ["cpu@0.32.0", "sm70@1.2.2", "sm70@1.3.0"]
    assert engine_lock.default_version("sm70") == "1.3.0"
    prof = engine_lock.profile("sm70")
    assert prof["sha256"] == "2bdb14a9c44f83ee6a766d88ed0d85b11390d6f5d65747e8dbe80a8e2d5d63e0"
    assert prof["size"] == 68_764_308 and prof["wheel"] == "1cat_vllm-1.3.0-cp312-cp312-linux_x86_64.whl"
    old = engine_lock.profile("sm70", "1.2.2")
    assert old["sha256"] == "8a628983ad9d675559910372643220c418b307ddc7fd52ac65a7f5fbcb104bc6"
    assert old["companions_conflict_expected"] and not prof["companions_conflict_expected"]
    with pytest.raises(engine_lock.LockError, match="1.2.9 is not locked.*1.3.0, 1.2.2"):
        engine_lock.profile("sm70", "1.2.9")


@pytest.mark.parametrize("found, ok", [
    ("1.3.0", True), ("1.3.0+cu128", True), ("1.3.0+precompiled", True),
    ("1.3.0+", False), ("1.3.0.post1", False), ("1.3.1", False), ("1.2.2+cu128", False), (None, False),
])
def test_version_check_accepts_exactly_the_locked_version_with_a_local_suffix(found, ok):
    prof = engine_lock.profile("sm70", "1.3.0")
    if ok:
        assert engine_lock.check_version(found, prof) == found
    else:
        with pytest.raises(engine_lock.LockError) as err:
            engine_lock.check_version(found, prof)
        assert f"reports 1cat-vllm {found or 'nothing'}" in str(err.value)
        if found == "1.2.2+cu128":
            assert "ENGINE_VERSION=1.2.2" in str(err.value)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_hook_is_proven_against_the_1cat_archive(version):
    src = engine_source.open_source(_archive(version))
    assert src.key == f"sm70@{version}"
    rows = engine_source.verify(src)
    assert [r.hook for r in rows] == [h.name for h in REGISTRY]
    misses = [f"{r.hook}: {r.detail}" for r in rows if r.miss]
    assert not misses, misses
    applied = {r.hook for r in rows if r.status == "ok"}
    assert applied == {h.name for h in hooks_for(src.key)}
    for r in rows:
        if r.status == "n/a":
            assert r.detail  # says why
    registration = {r.hook: r for r in engine_source.verify_registration(src)}
    assert not [r for r in registration.values() if r.miss], [r.detail for r in registration.values() if r.miss]
    # 1Cat's experts are asked for through the closure in FusedMoE.__init__ (RoutedExperts is its alias)
    experts = registration["qpn-config-asked-for-experts"]
    assert "FusedMoE.__init__ calls get_quant_method()" in experts.anchor
    assert "called at vllm/model_executor/layers/fused_moe/layer.py:" in experts.detail


def test_every_hook_is_proven_against_the_installed_cpu_engine():
    site = _engine_site_packages()
    if not (site / "vllm").is_dir():
        pytest.skip("no engine installed for QPN_ENGINE_PYTHON")
    src = engine_source.open_source(site)
    assert src.key == "cpu@0.32.0"
    rows = engine_source.verify(src) + engine_source.verify_registration(src)
    assert not [r for r in rows if r.miss], engine_source.table(rows, src)
    experts = next(r for r in rows if r.hook == "qpn-config-asked-for-experts")
    assert "RoutedExperts._get_quant_method calls resolve_quant_method()" in experts.anchor
    assert {r.hook for r in rows if r.kind == "disk" and r.status == "ok"} == {
        h.name for h in hooks_for("cpu", kind="disk")}


def _renamed_copy(archive: Path, dest: Path, relpath: str, old: str, new: str) -> Path:
    """A copy of ``archive`` with one text edit in one member (a renamed anchor)."""
    out = dest / archive.name.replace("-src", "-renamed-src")
    with tarfile.open(archive) as src, tarfile.open(out, "w:gz") as dst:
        for m in src:
            data = src.extractfile(m).read() if m.isfile() else None
            if m.isfile() and m.name.endswith(relpath):
                text = data.decode()
                assert text.count(old) == 1
                data = text.replace(old, new).encode()
                m.size = len(data)
            dst.addfile(m, io.BytesIO(data) if data is not None else None)
    return out


def test_cli_passes_on_the_archive_and_fails_naming_the_hook_on_a_renamed_anchor(tmp_path):
    archive = _archive("1.3.0")
    good = _cli(str(archive))
    assert good.returncode == 0, good.stdout + good.stderr
    assert "engine sm70@1.3.0" in good.stdout and "0 MISS" in good.stdout
    assert "| qpn-config-probed-first | registry | ok |" in good.stdout  # the registration path too
    bad_archive = _renamed_copy(archive, tmp_path, "vllm/transformers_utils/model_arch_config_convertor.py",
                                "def _normalize_quantization_config(self",
                                "def _normalise_quantization_config(self")
    bad = _cli(str(bad_archive), "--engine", "sm70@1.3.0")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert ("MISS hook modelopt-mixed-precision-file-form on engine sm70@1.3.0: class "
            "ModelArchConfigConvertorBase" in bad.stdout), bad.stdout
    assert "defines no _normalize_quantization_config" in bad.stdout
    assert "1 MISS" in bad.stdout


def test_a_moved_call_site_and_changed_parameters_are_misses(tmp_path):
    archive = _archive("1.3.0")
    moved = _renamed_copy(archive, tmp_path, "vllm/model_executor/layers/fused_moe/layer.py",
                          "quant_method = self.quant_config.get_quant_method(self, prefix)",
                          "quant_method = self.quant_config.quant_method_for(self, prefix)")
    src = engine_source.open_source(moved, "1.3.0", "sm70")
    rows = {r.hook: r for r in engine_source.verify_registration(src)}
    assert rows["qpn-config-asked-for-experts"].miss
    assert "FusedMoE.__init__ no longer calls .get_quant_method" in rows["qpn-config-asked-for-experts"].detail
    assert not rows["qpn-config-asked-for-linear"].miss
    cli = _cli(str(moved), "--engine", "sm70@1.3.0")
    assert cli.returncode == 1 and "MISS hook qpn-config-asked-for-experts on engine sm70@1.3.0" in cli.stdout
    sub = tmp_path / "p"
    sub.mkdir()
    renamed = _renamed_copy(archive, sub, "vllm/transformers_utils/model_arch_config_convertor.py",
                            "def _normalize_quantization_config(self, config: PretrainedConfig):",
                            "def _normalize_quantization_config(self, config: PretrainedConfig, strict):")
    rows = {r.hook: r for r in engine_source.verify(engine_source.open_source(renamed, "1.3.0", "sm70"))}
    detail = rows["modelopt-mixed-precision-file-form"].detail
    assert rows["modelopt-mixed-precision-file-form"].miss and "(self, config, strict)" in detail, detail


# The engine config class that parses each convention of tests/_onecat_claim_probe.py under QPN
ENGINE_CONFIGS = {"modelopt-mixed": "ModelOptMixedPrecisionConfig", "modelopt-nvfp4": "ModelOptNvFp4Config",
                  "modelopt-fp8": "ModelOptFp8Config", "ct-nvfp4-fp8": "CompressedTensorsConfig",
                  "awq": "AWQConfig", "gptq": "AutoGPTQConfig", "ct-int4": "CompressedTensorsConfig"}


@pytest.mark.engine
@pytest.mark.parametrize("version", VERSIONS)
def test_plugin_registers_against_the_real_1cat_modules(version, tmp_path):
    engine_dir = engine_source.extract(_archive(version), tmp_path, version)
    probe = (REPO / "tests" / "_onecat_claim_probe.py").read_text()
    result = engine_source.import_check(engine_dir, "sm70", version, extra_code="\n" + probe)
    assert result["vllm_file"].startswith(str(engine_dir)), result["vllm_file"]
    assert result["version"] == version and result["engine"] == f"sm70@{version}"
    assert result["register"] == "ok", result["stderr"]
    assert result["skipped"] == []
    expected = {h.name for h in hooks_for(f"sm70@{version}", kind="runtime")}
    assert {h["hook"] for h in result["hooks"]} == expected
    not_applied = [h for h in result["hooks"] if not h["applied"]]
    assert not not_applied, not_applied
    line = [x for x in result["stdout"].splitlines() if x.startswith("QPN_CLAIM_1CAT ")]
    assert line, result["stderr"]
    claim = json.loads(line[0][len("QPN_CLAIM_1CAT "):])
    assert claim["registered"] and claim["count"] == 1  # the plugin registered "qpn" once
    # 1Cat's own _verify_quantization: every convention's checkpoint settles on "qpn" ...
    assert claim["with_qpn"] == {name: "qpn" for name in claim["with_qpn"]}, claim["with_qpn"]
    assert len(claim["with_qpn"]) == 7
    # ... ahead of the built-in that claims it when "qpn" is not registered; the engine's own config
    # class of the convention parses it under QPN (AWQ: 1Cat's AWQConfig, whose awq_marlin variant
    # claims AWQ checkpoints for the engine's Marlin kernels)
    assert claim["inner"] == ENGINE_CONFIGS, claim["inner"]
    assert claim["engine_only"] == {**ENGINE_CONFIGS, "awq": "AWQMarlinConfig"}, claim["engine_only"]
    assert claim["int4_off"] == {n: claim["engine_only"][n] for n in ("awq", "gptq", "ct-int4")}  # QPN_INT4=0


def test_registry_per_engine_fields_name_real_engines_and_load():
    keys = set(engine_lock.engine_keys())
    profiles = {k.partition("@")[0] for k in keys}
    from qpn.fork_patches.engine.hooks import NEEDED_FOR

    for hook in REGISTRY:
        assert hook.needed_for in NEEDED_FOR, hook.name
        for table in (hook.anchors, hook.apply_on, hook.not_on):
            unknown = set(table) - keys - profiles
            assert not unknown, f"{hook.name}: {unknown} is neither a locked engine nor a profile"
        for reason in hook.not_on.values():
            assert len(reason) > 10, f"{hook.name}: say why it does not apply"
        if hook.kind == "disk":
            assert hook.targets, f"{hook.name}: a disk hook declares the text it rewrites"
        for key in keys:
            if hook.applies_to(key):
                assert callable(hook.load(key)), (hook.name, key)
    # every locked engine has its hooks decided: applies, or says why not
    for key in keys:
        for hook in REGISTRY:
            assert hook.applies_to(key) or hook.skip_reason(key)
