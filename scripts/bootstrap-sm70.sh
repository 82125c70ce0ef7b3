#!/usr/bin/env bash
# Install the pinned engine, overlay volta-qpn onto it, build the QPN kernels.
# Thin wrapper: the logic is scripts/install/bootstrap.py (qpn.scripts.install.bootstrap); see its --help.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
exec "${BOOTSTRAP_PYTHON:-python3}" -m qpn.scripts.install.bootstrap "$@"
