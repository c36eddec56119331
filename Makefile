# Small entry points; scripts/ hold the logic.
GO ?= go

.PHONY: build test cuda cuda-test-bin device-check image-test

# The README's set-up: the daemon, its loader, the load generator and
# grpcurl (pinned, from the Go module proxy) into ./bin, the names the
# README uses once ./bin is on PATH.
build:
	$(GO) build -o bin/ ./cmd/expertd ./cmd/expertd-load ./cmd/expertbench
	scripts/grpcurl-install.sh bin

# The README's test command: the tools the end-to-end tests drive the daemon
# with (grpcurl, a Python venv with grpcio), then every test with the race
# detector. EXPERTD_E2E_REQUIRE=1 turns a missing tool into a failure.
# e2e's tests run one after another (the README walk-through, the pytest
# suite, restarts under load) and can outlast go test's default 10-minute
# limit on a busy two-core machine.
test:
	scripts/e2e-setup.sh
	EXPERTD_E2E_REQUIRE=1 $(GO) test -race -count=1 -timeout 30m ./...
	cd deploy && $(GO) test -race -count=1 ./...

# build/libexpertd_cuda.so (installs the pinned CUDA 13.0 wheels if needed).
cuda:
	scripts/cuda-install.sh
	scripts/cuda-build.sh

# Cross-built, cgo-free binaries for the device machine (which has no Go).
cuda-test-bin:
	mkdir -p build
	CGO_ENABLED=0 GOOS=linux GOARCH=amd64 $(GO) test -c -o build/cuda.test ./kernels/cuda
	CGO_ENABLED=0 GOOS=linux GOARCH=amd64 $(GO) build -o build/expertd ./cmd/expertd
	CGO_ENABLED=0 GOOS=linux GOARCH=amd64 $(GO) build -o build/expertbench ./cmd/expertbench
	CGO_ENABLED=0 GOOS=linux GOARCH=amd64 $(GO) build -o build/expertd-load ./cmd/expertd-load

# Run on the device machine (carry build/): see scripts/device-check.sh.
device-check:
	scripts/device-check.sh

# Build the container image with buildah and run it (scripts/image-test.sh).
image-test:
	scripts/image-test.sh
