#!/usr/bin/env bash
# Set up and run the example job on this machine (local processes, SQLite).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python examples/shard_service_demo.py "$@"
