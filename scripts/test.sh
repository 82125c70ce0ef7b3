#!/usr/bin/env bash
# The test suite on a fresh machine: bootstrap the cpu engine (reused when already there), add the
# test tools to it, run pytest inside it. GPU tests skip without a GPU. Arguments go to pytest.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ENV_PREFIX="${QPN_TEST_ENV_PREFIX:-$REPO/.venv-cpu}"
ENGINE=cpu ENV_PREFIX="$ENV_PREFIX" bash "$REPO/scripts/bootstrap-sm70.sh"
echo "[test] installing the test tools into $ENV_PREFIX"
"$ENV_PREFIX/bin/python" -m pip install -q --no-build-isolation "$REPO[test,bench]"
# NVIDIA's own exporter, for the cross-check of our checkpoint generator. It lives in a venv
# of its own (it pins packages of its own and must never touch the engine); best effort: if it
# cannot be installed, that one test skips and says why.
MODELOPT_PREFIX="${QPN_MODELOPT_PREFIX:-$REPO/.venv-modelopt}"
if [ ! -x "$MODELOPT_PREFIX/bin/python" ] || ! "$MODELOPT_PREFIX/bin/python" -c "import modelopt" 2>/dev/null; then
  echo "[test] installing nvidia-modelopt 0.47 into $MODELOPT_PREFIX (cross-check of the generator)"
  python3 -m venv "$MODELOPT_PREFIX" && "$MODELOPT_PREFIX/bin/python" -m pip install -q \
    "torch==2.13.0" "nvidia-modelopt==0.47.*" "transformers==5.19.0" requests safetensors \
    || echo "[test] WARNING: nvidia-modelopt could not be installed; its cross-check will skip"
fi
if "$MODELOPT_PREFIX/bin/python" -c "import modelopt" 2>/dev/null; then
  export QPN_MODELOPT_PYTHON="$MODELOPT_PREFIX/bin/python"
fi
cd "$REPO"
export QPN_ENGINE_PYTHON="$ENV_PREFIX/bin/python"
exec "$ENV_PREFIX/bin/python" -m pytest -ra "$@"
