#!/usr/bin/env bash
# Serve a Qwen3.8 NVFP4/FP8 checkpoint through vLLM + the QPN overlay; exits non-zero unless the
# boot gates pass. Settings are environment variables (K, MML, MNS, GMU, PORT, HOST, CAPTURE,
# ENV_PREFIX, VLLM_API_KEY, ...): see docs/serving.md. Logic lives in scripts/launcher/serve.py.
#   bash scripts/serve-qwen38-native.sh CKPT_DIR [extra vLLM arguments]
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The launcher runs under the engine's python when there is one (it reads the census with the
# overlay's own reader); otherwise under python3, which reports the missing engine.
PY="$(command -v python3)"
for candidate in "${QPN_ENGINE_PYTHON:-}" "${ENV_PREFIX:+$ENV_PREFIX/bin/python}" \
                 "$REPO_ROOT/.venv-sm70/bin/python" "$REPO_ROOT/.venv-cpu/bin/python"; do
  if [ -n "$candidate" ] && [ -x "$candidate" ]; then PY="$candidate"; break; fi
done
# From a source checkout, `qpn` resolves through the repository root (qpn/__init__.py).
[ -f "$REPO_ROOT/qpn/__init__.py" ] && export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m qpn.scripts.launcher.serve "$@"
