#!/usr/bin/env bash
# The demonstration on any machine (no GPU needed): builds the cpu engine if absent, writes a
# small mixed NVFP4/FP8 checkpoint, serves it through serve-qwen38-native.sh with MTP and the
# boot gates, sends a chat and a streaming request, prints the answer, the route census and the
# gate table, and shuts everything down. Settings: CONVENTION=modelopt (default) or
# compressed-tensors (the checkpoint family), MOE=1 (the MoE model family), K (MTP depth, default 3),
# DEMO_DIR, ENV_PREFIX, PORT. Logic: scripts/launcher/demo.py.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
PY="${ENV_PREFIX:-$REPO_ROOT/.venv-cpu}/bin/python"
# The demo itself needs the openai client, which the engine ships; before the engine exists,
# python3 runs it far enough to bootstrap the engine, then it re-runs under the engine.
if [ ! -x "$PY" ]; then
  python3 -c 'import qpn.scripts.launcher.demo as d, os; d.engine_python(dict(os.environ))'
fi
exec "$PY" -m qpn.scripts.launcher.demo "$@"
