# syntax=docker/dockerfile:1
# Multi-stage: build `ipreclaim` (both programs) with the pinned toolchain, ship it alone on a
# distroless, non-root base (no shell, no package manager).

FROM docker.io/library/rust:1.95-bookworm AS build
# k8s-cri generates the CRI client at build time and needs protoc.
RUN apt-get update \
 && apt-get install -y --no-install-recommends protobuf-compiler \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin ipreclaim \
 && cp target/release/ipreclaim /usr/local/bin/ipreclaim

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /usr/local/bin/ipreclaim /usr/local/bin/ipreclaim
# nonroot (65532); the node agent's DaemonSet runs it as root to open the CRI socket.
USER 65532:65532
EXPOSE 8080 8081
ENTRYPOINT ["/usr/local/bin/ipreclaim"]
CMD ["--help"]
