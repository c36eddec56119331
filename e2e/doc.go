// Package e2e holds end-to-end tests: they build the real daemon
// (./cmd/expertd), start it on a loopback port and drive it the ways a
// user would: with the Go SDK, with grpcurl and with a Python grpcio
// client, each result checked against kerneltest's float64 reference.
//
// grpcurl and the Python venv come from scripts/e2e-setup.sh (into
// .tools/e2e); without them those tests are skipped with a loud message,
// or fail when EXPERTD_E2E_REQUIRE=1, as in CI. $EXPERTD_GRPCURL and
// $EXPERTD_PYTHON point at other installs.
package e2e
