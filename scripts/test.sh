#!/usr/bin/env bash
# Set up and run the whole test suite: lint, types, import contracts, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
echo "== Kubernetes test environment (built once, then cached)"
scripts/kube_env.sh | tail -1
echo "== ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== mypy --strict"
.venv/bin/mypy
echo "== import contracts"
.venv/bin/python tools/lint_imports.py | grep -aE "KEPT|BROKEN|->|Contracts"
echo "== pytest"
# The slowest tests are listed last, where a CI log's tail shows them.
.venv/bin/python -m pytest --durations=30 "$@"
