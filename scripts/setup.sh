#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv.
#
# torch is installed first and pinned to the 2.13.0 CPU build, so that nothing
# later pulls the newest release with gigabytes of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PYTHON" -m venv .venv
fi
pip_install() { .venv/bin/python -m pip install --quiet --disable-pip-version-check "$@"; }
if ! .venv/bin/python -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  echo "setup: installing torch 2.13.0 (CPU)"
  pip_install "torch==2.13.0"
fi
echo "setup: installing dlfleet (editable) with master, postgres, mysql, kubernetes, worker and dev extras"
pip_install -e ".[master,postgres,mysql,kubernetes,worker,dev]"
