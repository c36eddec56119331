#!/usr/bin/env bash
# image-test.sh builds the container image from the Dockerfile with a
# daemonless builder (buildah, from Debian's packages) and runs it: the
# daemon must answer /livez, /readyz and gRPC health, and a FusedMoE call on
# the CPU backend must match the float64 reference (e2e TestImage).
#
# No base image can be pulled here, so both bases are made from Debian's
# packages: a bookworm root file system from mmdebstrap (the runtime base),
# and a build base with the host's Go toolchain copied in. Both are kept in
# buildah's store and reused on later runs.
#
# Running: podman's OCI runtime (crun) cannot start containers in this CI
# sandbox ("crun: setrlimit `RLIMIT_NOFILE`: Operation not permitted: OCI
# permission denied"), so the image runs with `buildah run --isolation
# chroot`: the image's root file system, user, entrypoint environment and
# binary, in the host's network namespace. Set IMAGE_RUNTIME=podman where
# podman can run containers.
#
# Environment: CUDA_LIB=prebuilt (default when build/libexpertd_cuda.so
# exists, i.e. after make cuda) copies the library CI has just compiled
# instead of compiling it again; CUDA_LIB=build compiles it in the image.
# Needs root (as CI runs). Installs buildah and mmdebstrap with apt-get if
# missing.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
step() { printf '\n--> image-test: %s\n' "$*"; }

export STORAGE_DRIVER=vfs BUILDAH_ISOLATION=chroot
ba() { buildah --storage-driver vfs "$@"; }
tag="localhost/expertd:test"
base="localhost/expertd-debian:bookworm"
gobase="localhost/expertd-golang:$(go env GOVERSION)-bookworm"

if ! command -v buildah >/dev/null || ! command -v mmdebstrap >/dev/null; then
  step "installing buildah and mmdebstrap (Debian packages)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq buildah mmdebstrap >/dev/null
fi

if ! ba inspect --type image "$base" >/dev/null 2>&1; then
  step "runtime base from Debian packages (mmdebstrap bookworm, minbase)"
  tmp="$(mktemp -d)"
  mmdebstrap --quiet --variant=minbase --include=ca-certificates bookworm "$tmp/base.tar"
  c="$(ba from scratch)"
  ba add "$c" "$tmp/base.tar" / >/dev/null
  ba config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd /bin/bash "$c"
  ba commit --quiet "$c" "$base" >/dev/null
  ba rm "$c" >/dev/null
  rm -rf "$tmp"
fi
if ! ba inspect --type image "$gobase" >/dev/null 2>&1; then
  step "build base: $base with $(go env GOVERSION) from $(go env GOROOT)"
  c="$(ba from "$base")"
  ba copy "$c" "$(go env GOROOT)" /usr/local/go >/dev/null
  # The build reaches the network as this host does, so it trusts the CAs
  # this host trusts (a CI egress proxy's, for one).
  ba copy "$c" /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt >/dev/null
  ba config --env PATH=/usr/local/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --env GOTOOLCHAIN=local "$c"
  ba commit --quiet "$c" "$gobase" >/dev/null
  ba rm "$c" >/dev/null
fi

cuda="${CUDA_LIB:-}"
if [[ -z "$cuda" ]]; then
  cuda=build
  [[ -f build/libexpertd_cuda.so ]] && cuda=prebuilt
fi
version="$(git describe --tags --always --dirty 2>/dev/null || echo dev)"
commit="$(git rev-parse HEAD 2>/dev/null || true)"
step "building $tag (CUDA_LIB=$cuda, VERSION=$version)"
start=$SECONDS
# The stamps replace the VCS data (the context has no .git).
# The host's module cache is mounted into the build's RUN steps, so
# modules already downloaded here are not fetched again.
ba bud --quiet --format docker --layers=false \
  --volume "$(go env GOMODCACHE):/root/go/pkg/mod" \
  --build-arg GO_IMAGE="$gobase" --build-arg BASE_IMAGE="$base" --build-arg CUDA_LIB="$cuda" \
  --build-arg VERSION="$version" --build-arg COMMIT="$commit" \
  -t "$tag" . >/dev/null
echo "built in $((SECONDS - start))s"
ba inspect --type image --format '{{.Docker.Config.User}} {{.Docker.Config.Entrypoint}} {{.Docker.Config.ExposedPorts}} {{.Docker.Config.Healthcheck.Test}}' "$tag"

step "running the image: e2e TestImage"
EXPERTD_IMAGE="$tag" EXPERTD_IMAGE_RUNTIME="${IMAGE_RUNTIME:-buildah}" EXPERTD_IMAGE_VERSION="$version" \
  go test -count=1 -run '^TestImage$' -v ./e2e 2>&1 | tail -40
exit "${PIPESTATUS[0]}"
