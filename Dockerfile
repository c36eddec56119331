# syntax=docker/dockerfile:1
# The expertd image: the daemon (CGO_ENABLED=0) and libexpertd_cuda.so
# (nvcc from NVIDIA's pinned CUDA 13.0 wheels, as CI builds it) on a small
# Debian runtime, run as a non-root user. The GPU driver (>= 580 for CUDA
# 13) comes from the host through the NVIDIA container toolkit; the image
# carries no CUDA runtime (the library links it statically).
#
#   docker build --build-arg VERSION=v1.2.0 --build-arg COMMIT=$(git rev-parse HEAD) -t expertd:v1.2.0 .
#
# Build arguments:
#   GO_IMAGE, BASE_IMAGE  the build and runtime bases (CI makes both from
#                         Debian packages: scripts/image-test.sh)
#   VERSION, COMMIT       stamped into the binary (expertd -version, GetServerInfo)
#   CUDA_LIB              "build" compiles the library (default); "prebuilt"
#                         copies build/libexpertd_cuda.so from the context
#                         (make cuda), for CI, which has just compiled it
ARG GO_IMAGE=docker.io/library/golang:1.26-bookworm
ARG BASE_IMAGE=docker.io/library/debian:bookworm-slim
ARG CUDA_LIB=build

FROM ${GO_IMAGE} AS daemon
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=
ARG COMMIT=
# -trimpath keeps build paths out of the binary; the stamps override the
# VCS data the go tool cannot read without .git in the context.
RUN CGO_ENABLED=0 go build -trimpath \
      -ldflags "-s -w ${VERSION:+-X main.buildVersion=$VERSION} ${COMMIT:+-X main.buildCommit=$COMMIT}" \
      -o /out/expertd ./cmd/expertd && /out/expertd -version

FROM ${GO_IMAGE} AS cuda-build
RUN apt-get update && apt-get install -y --no-install-recommends g++ python3-pip && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY scripts/cuda-install.sh scripts/cuda-build.sh scripts/cutlass-install.sh scripts/wheels.sh scripts/nvcc-env.sh scripts/
COPY kernels/cuda/csrc kernels/cuda/csrc
RUN scripts/cuda-install.sh && scripts/cuda-build.sh && rm -rf .tools

FROM ${GO_IMAGE} AS cuda-prebuilt
COPY build/libexpertd_cuda.so /src/build/libexpertd_cuda.so

FROM cuda-${CUDA_LIB} AS cuda

FROM ${BASE_IMAGE}
# The daemon finds the library at ../lib/libexpertd_cuda.so beside its
# executable (kernels/cuda's default search), so no flag is needed.
COPY --from=daemon /out/expertd /usr/local/bin/expertd
COPY --from=cuda /src/build/libexpertd_cuda.so /usr/local/lib/libexpertd_cuda.so
COPY LICENSE /usr/share/doc/expertd/LICENSE
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin expertd \
 && mkdir -p /weights && chown expertd:expertd /weights
USER 10001:10001
# Inside a container loopback-only listeners are unreachable; expose both.
# Without TLS or tokens the daemon logs a warning: set them (the chart's
# values) or keep the ports on a private network.
ENV EXPERTD_LISTEN=0.0.0.0:50051 \
    EXPERTD_ADMIN_ADDR=0.0.0.0:9090 \
    EXPERTD_LOG_FORMAT=json \
    EXPERTD_WEIGHTS_DIR=/weights
EXPOSE 50051 9090
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s CMD ["/usr/local/bin/expertd", "-probe", "http://127.0.0.1:9090/livez"]
ENTRYPOINT ["/usr/local/bin/expertd"]
