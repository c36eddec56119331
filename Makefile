# Small entry points; scripts/ hold the logic.
GO ?= go

.PHONY: cuda cuda-test-bin device-check

# build/libexpertd_cuda.so (installs the pinned CUDA 13.0 wheels if needed).
cuda:
	scripts/cuda-install.sh
	scripts/cuda-build.sh

# Cross-built, cgo-free binaries for the device machine (which has no Go).
cuda-test-bin:
	mkdir -p build
	CGO_ENABLED=0 GOOS=linux GOARCH=amd64 $(GO) test -c -o build/cuda.test ./kernels/cuda
	if [ -d cmd/expertd ]; then CGO_ENABLED=0 GOOS=linux GOARCH=amd64 $(GO) build -o build/expertd ./cmd/expertd; fi

# Run on the device machine (carry build/): see scripts/device-check.sh.
device-check:
	scripts/device-check.sh
