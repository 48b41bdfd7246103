# syntax=docker/dockerfile:1
# Multi-stage, multi-arch: build `ipreclaim` (both programs) with the pinned toolchain on the
# build machine's platform, cross-compiling for the target platform (TARGETARCH: amd64 or arm64),
# and ship it alone on a distroless, non-root base (no shell, no package manager).
#
#   docker build -t ipreclaim:dev .                                  # this machine's platform
#   docker buildx build --platform linux/amd64,linux/arm64 -t REG/ipreclaim:TAG --push .
#
# Dependencies are compiled in their own layer (cargo-chef: it changes only when Cargo.toml or
# Cargo.lock do), and the binary is built with `cargo auditable`, which embeds its dependency
# list (`cargo audit bin`, syft and trivy read it).

ARG RUST_VERSION=1.95
# The base images, by name: a mirror or a pinned digest is a build argument, the steps stay.
ARG BUILD_BASE=docker.io/library/rust:${RUST_VERSION}-bookworm
ARG RUNTIME_BASE=gcr.io/distroless/cc-debian12:nonroot
ARG VERSION=0.0.0-dev
ARG REVISION=unknown
ARG CREATED=unknown

# --- tools, on the build platform -----------------------------------------------------------
FROM --platform=$BUILDPLATFORM ${BUILD_BASE} AS chef
ARG TARGETARCH
# k8s-cri generates the CRI client at build time and needs protoc; ring needs a C compiler for
# the target.
RUN apt-get update \
 && apt-get install -y --no-install-recommends protobuf-compiler \
 && if [ "$TARGETARCH" = arm64 ] && [ "$(dpkg --print-architecture)" != arm64 ]; then \
      apt-get install -y --no-install-recommends gcc-aarch64-linux-gnu libc6-dev-arm64-cross; \
    fi \
 && if [ "$TARGETARCH" = amd64 ] && [ "$(dpkg --print-architecture)" != amd64 ]; then \
      apt-get install -y --no-install-recommends gcc-x86-64-linux-gnu libc6-dev-amd64-cross; \
    fi \
 && rm -rf /var/lib/apt/lists/*
RUN cargo install --locked cargo-chef@0.1.78 cargo-auditable@0.7.7
# The Rust target of TARGETARCH, and its linker when cross-compiling.
RUN case "$TARGETARCH" in \
      amd64) echo x86_64-unknown-linux-gnu > /rust-target ;; \
      arm64) echo aarch64-unknown-linux-gnu > /rust-target ;; \
      *) echo "unsupported TARGETARCH=$TARGETARCH (amd64, arm64)" >&2; exit 1 ;; \
    esac \
 && rustup target add "$(cat /rust-target)"
ENV CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc \
    CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc \
    CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_LINKER=x86_64-linux-gnu-gcc \
    CC_x86_64_unknown_linux_gnu=x86_64-linux-gnu-gcc
# On a native build the cross gcc names do not exist: use the plain gcc.
RUN for cc in aarch64-linux-gnu-gcc x86_64-linux-gnu-gcc; do \
      command -v "$cc" >/dev/null || ln -s "$(command -v gcc)" "/usr/local/bin/$cc"; \
    done
WORKDIR /src

# --- the dependency recipe (only manifests and the lock file matter) ----------------------
FROM chef AS planner
COPY . .
RUN cargo chef prepare --recipe-path recipe.json

# --- dependencies, then the binary ----------------------------------------------------------
FROM chef AS build
COPY --from=planner /src/recipe.json recipe.json
RUN cargo chef cook --release --locked --target "$(cat /rust-target)" --recipe-path recipe.json --bin ipreclaim
COPY . .
# The target directory goes in the same step: a layer cache (buildah --layers, a CI machine that
# keeps its store) would otherwise keep a copy of the build's artifacts for every commit.
RUN cargo auditable build --release --locked --target "$(cat /rust-target)" --bin ipreclaim \
 && cp "target/$(cat /rust-target)/release/ipreclaim" /usr/local/bin/ipreclaim \
 && rm -rf target

# --- runtime --------------------------------------------------------------------------------
FROM ${RUNTIME_BASE}
ARG RUNTIME_BASE
ARG VERSION
ARG REVISION
ARG CREATED
LABEL org.opencontainers.image.title="ipreclaim" \
      org.opencontainers.image.description="Reclaims leaked IP addresses from whereabouts IPAM pools (controller + node agent)" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://example.invalid/ipreclaim" \
      org.opencontainers.image.url="https://example.invalid/ipreclaim" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.base.name="${RUNTIME_BASE}"
COPY --from=build /usr/local/bin/ipreclaim /usr/local/bin/ipreclaim
# nonroot (65532); the node agent's DaemonSet runs it as root to open the CRI socket.
USER 65532:65532
EXPOSE 8080 8081
ENTRYPOINT ["/usr/local/bin/ipreclaim"]
CMD ["--help"]
