#!/usr/bin/env bash
# Regenerates the Go code for proto/ and lints the contract, with the buf
# and protoc plugins pinned in tools/go.mod. Usage: scripts/gen-proto.sh
set -euo pipefail
cd "$(dirname "$0")/../proto"
buf=(go tool -modfile=../tools/go.mod buf)
"${buf[@]}" lint
"${buf[@]}" format --diff --exit-code
"${buf[@]}" generate
