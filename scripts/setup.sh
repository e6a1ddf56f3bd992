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
# The editable install (and the wire code it generates from proto/) is redone
# only when what it is made from changed: the packaging files, the .proto
# files, the generator, the set of packages. A stamp in .venv remembers.
stamp=.venv/.dlfleet-install-stamp
fingerprint=$(
  { cat pyproject.toml setup.py tools/protogen.py proto/dlfleet/api/v1/*.proto
    find proto master worker brain -name __init__.py -not -path '*/build/*' | LC_ALL=C sort
  } | sha256sum | cut -d' ' -f1
)
if [ "$(cat "$stamp" 2>/dev/null)" = "$fingerprint" ] \
    && ls proto/dlfleet/api/v1/*_pb2.py >/dev/null 2>&1 \
    && .venv/bin/python -c 'import dlfleet.master, dlfleet.worker, dlfleet.brain' 2>/dev/null; then
  echo "setup: dlfleet is installed and unchanged (delete $stamp to reinstall)"
else
  echo "setup: installing dlfleet (editable) with master, postgres, mysql, kubernetes, worker, stream," \
    "frameworks and dev extras"
  pip_install -e ".[master,postgres,mysql,kubernetes,worker,stream,frameworks,dev]"
  echo "$fingerprint" >"$stamp"
fi

# The dashboard's browser test drives Debian's chromium through playwright
# (playwright's own browser download is never used). Installed when missing and
# apt-get can (root); elsewhere the test skips and says why.
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing chromium (Debian) for the dashboard's browser test"
    apt_log=$(mktemp)
    if ! { apt-get -o DPkg::Lock::Timeout=300 update -qq \
        && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq \
          --no-install-recommends chromium fonts-dejavu-core; } >"$apt_log" 2>&1; then
      echo "setup: could not install chromium (see $apt_log); the browser test will skip"
    else
      rm -f "$apt_log"
    fi
  else
    echo "setup: chromium is missing and apt-get is not usable here (root needed);" \
      "the dashboard's browser test will skip"
  fi
fi

# Prometheus (Debian's package), for the test that scrapes a running job with
# a real Prometheus server (tests/integration/master/test_prometheus_scrape.py).
# Installed only where it is missing and apt-get can be used as root; the
# package's service is never started (policy-rc.d), the test runs its own.
if command -v prometheus >/dev/null 2>&1; then
  :
elif [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "setup: prometheus is missing and apt-get cannot be used here (not root, or no" \
    "apt-get): the Prometheus scrape test skips (fails under CI=true) until it is installed"
else
  echo "setup: installing prometheus (apt-get)"
  policy=/usr/sbin/policy-rc.d
  made_policy=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && made_policy=1
    trap 'rm -f "$policy"' EXIT
  fi
  apt_install() {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      -o DPkg::Lock::Timeout=300 prometheus >/tmp/dlfleet-setup-apt.log 2>&1
  }
  if ! apt_install; then
    apt-get update -qq -o DPkg::Lock::Timeout=300 >>/tmp/dlfleet-setup-apt.log 2>&1 || true
    apt_install || echo "setup: could not install prometheus (see /tmp/dlfleet-setup-apt.log):" \
      "the Prometheus scrape test skips (fails under CI=true)"
  fi
  if [ "$made_policy" = 1 ]; then rm -f "$policy" && trap - EXIT; fi
fi
