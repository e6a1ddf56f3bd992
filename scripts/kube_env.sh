#!/usr/bin/env bash
# Build a local Kubernetes control plane for the Kubernetes tests (tests/kube):
# etcd from Debian, and kube-apiserver, kube-controller-manager, kube-scheduler
# and kubectl v1.20.2 built from Debian's source package (every Go dependency
# is vendored, so the build needs no network beyond the package mirror).
#
# Idempotent: when the four binaries are cached, it only checks the packages and
# prints the bin dir. The last line of stdout is always the bin dir; progress
# goes to stderr, prefixed "kube_env:". /etc/apt is never changed: the source
# package is fetched through a private APT configuration under the cache dir.
#
#   BIN=$(scripts/kube_env.sh | tail -n 1)
set -euo pipefail

K8S_VERSION=1.20.2
DEB_VERSION=1.20.5+really1.20.2-1.1+deb12u1
BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubectl)
# The build's name in the cache (tools/kubetest/cluster.py KUBE_BUILD): it
# changes when the build does. Built with Debian's Go (1.19), v1.20.2's
# vendored modern-go/reflect2 1.0.1 crashes the API server (SIGSEGV in map
# iteration) on the first custom resource it decodes; Debian's reflect2 1.0.2
# (golang-github-modern-go-reflect2-dev), the release that fixed it for Go
# 1.18+, replaces it in the vendor tree.
BUILD=v$K8S_VERSION+reflect2-1.0.2
REFLECT2=/usr/share/gocode/src/github.com/modern-go/reflect2
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/dlfleet/kubernetes-$BUILD
BIN=$CACHE/bin
MIRROR=${KUBE_ENV_MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${KUBE_ENV_SECURITY_MIRROR:-http://deb.debian.org/debian-security}

log() { echo "kube_env: $*" >&2; }

have_binaries() {
  local name
  for name in "${BINARIES[@]}"; do
    [ -x "$BIN/$name" ] || return 1
  done
}

install_packages() {
  local wanted=() cmd pkg
  # command:package pairs; Go is only needed when the binaries must be built.
  local pairs=(etcd:etcd-server etcdctl:etcd-client rsync:rsync jq:jq)
  have_binaries || pairs+=(go:golang-go)
  for pair in "${pairs[@]}"; do
    cmd=${pair%%:*}
    pkg=${pair#*:}
    command -v "$cmd" >/dev/null 2>&1 || wanted+=("$pkg")
  done
  have_binaries || [ -f "$REFLECT2/go_above_118.go" ] ||
    wanted+=(golang-github-modern-go-reflect2-dev)
  [ ${#wanted[@]} -eq 0 ] && return 0
  log "installing ${wanted[*]}"
  # Another apt (the machine's own, a setup running beside) may hold dpkg's
  # lock: wait for it, as scripts/setup.sh does, instead of failing at once.
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq \
    --no-install-recommends "${wanted[@]}" >&2
}

fetch_source() {
  local work=$1 apt=$1/apt
  mkdir -p "$apt/etc/sources.list.d" "$apt/etc/preferences.d" "$apt/state/lists/partial" \
    "$apt/cache/archives/partial"
  cat >"$apt/etc/sources.list" <<EOF
deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $MIRROR bookworm main
deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $MIRROR bookworm-updates main
deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $SECURITY_MIRROR bookworm-security main
EOF
  cat >"$apt/apt.conf" <<EOF
Dir::Etc::sourcelist "$apt/etc/sources.list";
Dir::Etc::sourceparts "$apt/etc/sources.list.d";
Dir::Etc::preferencesparts "$apt/etc/preferences.d";
Dir::State "$apt/state";
Dir::State::status "/var/lib/dpkg/status";
Dir::Cache "$apt/cache";
APT::Sandbox::User "root";
EOF
  log "fetching the source package kubernetes=$DEB_VERSION"
  APT_CONFIG=$apt/apt.conf apt-get -o DPkg::Lock::Timeout=300 update -qq >&2
  (cd "$work" && APT_CONFIG=$apt/apt.conf apt-get source -qq --download-only \
    "kubernetes=$DEB_VERSION" >&2)
  log "unpacking"
  (cd "$work" && dpkg-source -x --no-check ./kubernetes_*.dsc src >/dev/null)
}

build() {
  local src=$1/src
  log "building ${BINARIES[*]} (several minutes)"
  log "replacing the vendored modern-go/reflect2 1.0.1 with Debian's 1.0.2"
  local vendored=$src/vendor/github.com/modern-go/reflect2
  rm -f "$vendored"/*.go "$vendored"/*.s
  cp "$REFLECT2"/*.go "$REFLECT2"/*.s "$vendored/"
  mkdir -p "$src/.go/src/k8s.io"
  ln -sfn "$src" "$src/.go/src/k8s.io/kubernetes"
  # As debian/rules does: GOPATH inside the tree, vendored modules only.
  (
    cd "$src/.go/src/k8s.io/kubernetes"
    export GOPATH=$src/.go GOCACHE=$1/gocache GOPROXY=off GO111MODULE=on
    export CGO_ENABLED=0 KUBE_GIT_VERSION=v$K8S_VERSION KUBE_GIT_TREE_STATE=clean
    export KUBE_GIT_MAJOR=1 KUBE_GIT_MINOR=20
    make WHAT="cmd/kube-apiserver cmd/kube-controller-manager cmd/kube-scheduler cmd/kubectl" >&2
  )
  mkdir -p "$BIN.partial"
  for name in "${BINARIES[@]}"; do
    cp "$src/_output/local/go/bin/$name" "$BIN.partial/$name"
  done
  rm -rf "$BIN"
  mv "$BIN.partial" "$BIN"
}

install_packages
if have_binaries; then
  log "binaries cached in $BIN"
else
  started=$(date +%s)
  mkdir -p "$CACHE"
  work=$(mktemp -d "$CACHE/build.XXXXXX")
  fetch_source "$work"
  build "$work"
  log "removing the build tree"
  chmod -R u+w "$work" 2>/dev/null || true
  rm -rf "$work"
  log "built in $(($(date +%s) - started)) s into $BIN"
fi
log "$("$BIN/kube-apiserver" --version), $(etcd --version 2>/dev/null | sed -n 1p)"
echo "$BIN"
