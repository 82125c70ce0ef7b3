"""The QPN MoE methods' class names are part of how the engines load their experts.

vLLM 0.32 (``RoutedExperts.weight_loader``) and 1Cat-vLLM 1.2.2 / 1.3.0 (``FusedMoE.weight_loader``)
choose how a per-expert tensor lands by substrings of the quant method's class name, and by
nothing else: "ModelOpt" in the name selects the ModelOpt scale path (per-tensor ``weight_scale_2``
/ ``weight_scale`` and both w13 shards' input scales), "compressed" in the lower-cased name makes
the w1 and w3 input scales of an expert agree. So ``QPNModelOptMoEMethod`` must carry "ModelOpt",
and ``QPNCompressedTensorsMoEMethod`` must not (its per-expert, per-shard scales take the generic
path, by each parameter's ``quant_method`` attribute) while it carries "compressed". The hook
docstring of ``qpn.fork_patches.quant.moe_method`` says so. If an engine stops keying on the name (an attribute
or a method instead), the second test fails, and the QPN methods should use that mechanism.
"""
from __future__ import annotations

import ast
import importlib.util
import tarfile
from pathlib import Path

import pytest

from tests._ci import onecat_archive, unavailable

pytestmark = pytest.mark.fast

# Where each engine's expert loader is: (file inside vllm/, class, method).
ENGINE_LOADERS = {
    "cpu (vLLM 0.32)": ("model_executor/layers/fused_moe/routed_experts.py", "RoutedExperts", "weight_loader"),
    "1Cat 1.2.2": ("model_executor/layers/fused_moe/layer.py", "FusedMoE", "weight_loader"),
    "1Cat 1.3.0": ("model_executor/layers/fused_moe/layer.py", "FusedMoE", "weight_loader"),
}
# The name tests the loaders make: substring -> whether the name is lower-cased first.
NAME_TESTS = {"ModelOpt": False, "compressed": True}


def _engine_file(engine: str, relpath: str) -> str:
    if engine.startswith("1Cat"):
        archive = onecat_archive(engine.split()[-1])
        with tarfile.open(archive) as tar:
            for member in tar:
                if member.isfile() and member.name.endswith("/vllm/" + relpath):
                    return tar.extractfile(member).read().decode()
        pytest.fail(f"{archive} holds no vllm/{relpath}")
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        unavailable("the cpu engine's vllm", "vllm is not importable here",
                    "run the tests with the cpu engine venv (.venv-cpu/bin/python -m pytest)")
    return (Path(list(spec.submodule_search_locations)[0]) / relpath).read_text()


def _class_name_tests(func: ast.FunctionDef) -> dict[str, bool]:
    """The substrings ``func`` looks for in ``quant_method_name`` (-> lower-cased first), after
    checking that the name is the quant method's class name."""
    assigned = [n for n in ast.walk(func) if isinstance(n, ast.Assign)
                and [ast.unparse(t) for t in n.targets] == ["quant_method_name"]]
    assert [ast.unparse(n.value) for n in assigned] == ["self.quant_method.__class__.__name__"]
    found = {}
    for node in ast.walk(func):
        if (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.In)
                and isinstance(node.left, ast.Constant) and isinstance(node.left.value, str)):
            right = ast.unparse(node.comparators[0])
            if right in ("quant_method_name", "quant_method_name.lower()"):
                found[node.left.value] = right.endswith(".lower()")
    return found


def _method_of(tree: ast.Module, cls: str, name: str) -> ast.FunctionDef:
    """The method as Python binds it: the last definition (earlier ones may be typing overloads)."""
    defs = [item for node in tree.body if isinstance(node, ast.ClassDef) and node.name == cls
            for item in node.body if isinstance(item, ast.FunctionDef) and item.name == name]
    if not defs:
        pytest.fail(f"no {cls}.{name}")
    return defs[-1]


def _matches(class_name: str, substring: str, lowered: bool) -> bool:
    return substring in (class_name.lower() if lowered else class_name)


def test_the_qpn_moe_methods_take_the_loader_path_of_their_convention():
    pytest.importorskip("vllm")
    from qpn.fork_patches.quant import moe_method

    modelopt = moe_method.QPNModelOptMoEMethod.__name__
    ct = moe_method.QPNCompressedTensorsMoEMethod.__name__
    assert _matches(modelopt, "ModelOpt", False) and not _matches(modelopt, "compressed", True), modelopt
    assert not _matches(ct, "ModelOpt", False), (
        f"{ct} must not contain 'ModelOpt': the engines' expert loaders would take the ModelOpt scale path "
        "for compressed-tensors experts (see qpn.fork_patches.quant.moe_method)")
    assert _matches(ct, "compressed", True), ct
    assert issubclass(moe_method.QPNCompressedTensorsMoEMethod, moe_method.QPNModelOptMoEMethod)


@pytest.mark.parametrize("engine", sorted(ENGINE_LOADERS))
def test_the_engines_expert_loaders_still_key_on_the_class_name(engine):
    relpath, cls, name = ENGINE_LOADERS[engine]
    func = _method_of(ast.parse(_engine_file(engine, relpath)), cls, name)
    assert _class_name_tests(func) == NAME_TESTS, engine
