#!/usr/bin/env bash
# Set up .venv and run the quickstart job on this machine: an elastic DDP job
# of two local nodes (dlworker processes) driven by dlmaster, state in SQLite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/dlmaster --job-config examples/quickstart/job.yaml "$@"
