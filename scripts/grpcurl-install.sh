#!/usr/bin/env bash
# grpcurl-install.sh DIR puts grpcurl, at the pinned version, into DIR
# (built from the Go module proxy), unless that version is already there.
# make build (./bin) and scripts/e2e-setup.sh (.tools/e2e/bin) use it.
set -euo pipefail

version=v1.9.4
dir="$(mkdir -p "$1" && cd "$1" && pwd)"
stamp="$dir/.grpcurl-$version"
if [[ -f "$stamp" && -x "$dir/grpcurl" ]]; then
  echo "grpcurl $version already in $dir"
else
  echo "installing grpcurl $version into $dir"
  # Outside this module so its go.mod is neither read nor changed.
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && GOBIN="$dir" go install "github.com/fullstorydev/grpcurl/cmd/grpcurl@$version")
  rm -f "$dir"/.grpcurl-*
  touch "$stamp"
fi
"$dir/grpcurl" -version
