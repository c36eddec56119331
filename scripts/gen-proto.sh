#!/usr/bin/env bash
# Regenerates the Go code (and the documented descriptor set) for proto/
# and lints the contract, with the buf
# and protoc plugins pinned in tools/go.mod, then the Python package's
# stubs (scripts/gen-proto-python.sh). Usage: scripts/gen-proto.sh
set -euo pipefail
cd "$(dirname "$0")/.."
buf=(go tool -modfile=tools/go.mod buf)
"${buf[@]}" lint
"${buf[@]}" format --diff --exit-code
"${buf[@]}" generate
# The generated Go descriptors carry no comments; this descriptor set does,
# so server reflection (grpcurl describe) can show the documentation.
"${buf[@]}" build --exclude-imports --as-file-descriptor-set -o proto/expertd/v1/expert.binpb
# The Python package's stubs come from the same .proto (see that script).
scripts/gen-proto-python.sh
