#!/usr/bin/env bash
# One command for a V100 owner: GPU numerics tests, kernel benchmark, the performance model's V100
# estimate checked against it, the engine's own NVFP4 arms, end-to-end cells, into one results
# bundle with provenance (benchmarks/v100_evidence.py).
# Run it with the sm70 engine's python: ENV_PREFIX=<engine venv> bash scripts/v100-evidence.sh
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-${ENV_PREFIX:+$ENV_PREFIX/bin/python}}"
python="${python:-python3}"
cd "$here"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m qpn.benchmarks.v100_evidence "$@"
