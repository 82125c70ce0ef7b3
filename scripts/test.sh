#!/usr/bin/env bash
# The test suite on a fresh machine: bootstrap the cpu engine (reused when already there), add the
# test tools to it, run pytest inside it. GPU tests skip without a GPU. Arguments go to pytest.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ENV_PREFIX="${QPN_TEST_ENV_PREFIX:-$REPO/.venv-cpu}"
ENGINE=cpu ENV_PREFIX="$ENV_PREFIX" bash "$REPO/scripts/bootstrap-sm70.sh"
echo "[test] installing the test tools into $ENV_PREFIX"
"$ENV_PREFIX/bin/python" -m pip install -q --no-build-isolation "$REPO[test,bench]"
cd "$REPO"
export QPN_ENGINE_PYTHON="$ENV_PREFIX/bin/python"
exec "$ENV_PREFIX/bin/python" -m pytest -ra "$@"
