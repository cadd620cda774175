#!/usr/bin/env bash
# Builds etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kubectl from their
# published Go modules into a cache directory outside the repository, for the tests in tests/kube/
# and tests/e2e/. Idempotent: exits at once when the binaries for the pinned versions already
# exist, and builds only the missing ones otherwise.
#
#   tools/kube-testenv/build.sh          # build if needed, print the bin directory
#   NOCTAYA_KUBE_CACHE=/some/dir build.sh  # use another cache directory
#
# First run on a 2-core machine: see docs/install.md ("Test-time API server") for the measured time.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"

cache="${NOCTAYA_KUBE_CACHE:-${HOME}/.cache/noctaya-kube/k8s-${K8S_VERSION}-etcd-${ETCD_VERSION}}"
bin="$cache/bin"
binaries=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl)

all_built() {
  local b
  for b in "${binaries[@]}"; do [[ -x "$bin/$b" ]] || return 1; done
  [[ "$(cat "$bin/.versions" 2>/dev/null)" == "${K8S_VERSION} ${ETCD_VERSION}" ]]
}

# The binaries still to build: all of them after a version bump, else only those missing.
missing() {
  local b
  if [[ "$(cat "$bin/.versions" 2>/dev/null)" != "${K8S_VERSION} ${ETCD_VERSION}" ]]; then
    echo "${binaries[@]}"
    return
  fi
  for b in "${binaries[@]}"; do [[ -x "$bin/$b" ]] || echo -n "$b "; done
}

if all_built; then
  echo "$bin"
  exit 0
fi

if ! command -v go >/dev/null 2>&1; then
  echo "build.sh: the Go toolchain (go) is not on PATH; cannot build the test API server" >&2
  exit 3
fi

mkdir -p "$bin"
# Only one build at a time (two pytest sessions may start together); the second one waits and
# then finds the binaries built.
exec 9>"$cache/.build.lock"
if command -v flock >/dev/null 2>&1; then flock 9; fi
if all_built; then
  echo "$bin"
  exit 0
fi

# go.sum pins every hash; the checksum database is not reachable from every build machine.
export GOSUMDB="${GOSUMDB:-off}" GOTOOLCHAIN=local GOFLAGS="-mod=readonly -trimpath" CGO_ENABLED=0
start=$(date +%s)
tmp="$(mktemp -d "$cache/.build.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

k8s_minor="${K8S_VERSION#v1.}"; k8s_minor="${k8s_minor%%.*}"
k8s_ldflags="-s -w"
# The same version stamps the Kubernetes release build sets (hack/lib/version.sh), so
# `kubectl version` and the server's /version report the real release.
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  k8s_ldflags+=" -X ${pkg}.gitVersion=${K8S_VERSION} -X ${pkg}.gitMajor=1 -X ${pkg}.gitMinor=${k8s_minor}"
  k8s_ldflags+=" -X ${pkg}.gitTreeState=clean -X ${pkg}.buildDate=1970-01-01T00:00:00Z"
done

read -r -a todo <<< "$(missing)"
rm -f "$bin/.versions"
echo "build.sh: building ${todo[*]} (kubernetes ${K8S_VERSION}, etcd ${ETCD_VERSION}) into $bin" >&2
k8s_pkgs=()
for b in "${todo[@]}"; do [[ "$b" == etcd ]] || k8s_pkgs+=("k8s.io/kubernetes/cmd/$b"); done
if (( ${#k8s_pkgs[@]} )); then
  (cd "$here/k8s" && go build -ldflags="$k8s_ldflags" -o "$tmp/" "${k8s_pkgs[@]}")
fi
if [[ " ${todo[*]} " == *" etcd "* ]]; then
  (cd "$here/etcd" && go build -ldflags="-s -w" -o "$tmp/etcd" .)
fi

for b in "${todo[@]}"; do mv -f "$tmp/$b" "$bin/$b"; done
echo "${K8S_VERSION} ${ETCD_VERSION}" > "$bin/.versions"
echo "build.sh: built in $(( $(date +%s) - start ))s" >&2
echo "$bin"
