# syntax=docker/dockerfile:1
#
# attnserve images: the server and attnctl, run as a non-root user. Two targets,
# from the repository root:
#
#   docker build -t attnserve:0.2.0 .                                  # CUDA (the default target)
#   docker build --target runtime-cpu -t attnserve:0.2.0-cpu .         # CPU only, no CUDA
#   docker run --rm --gpus all -p 50051:50051 -p 9464:9464 attnserve:0.2.0 --backend=cuda
#   docker run --rm -p 50051:50051 attnserve:0.2.0-cpu --backend=cpu
#
# The CUDA image is built on CUDA 13 and Ubuntu 24.04 and also serves the CPU
# backend; the CPU image is built on Debian 12 with -DATTNSERVE_CUDA=OFF.
# Extra arguments are appended to the server's flags (docs/design.md section 6).
# tests/deploy/validate.sh checks this file against CMakeLists.txt and deploy/k8s/.

ARG CUDA_VERSION=13.0.0
ARG UBUNTU_VERSION=24.04
ARG DEBIAN_VERSION=12

# ---------------------------------------------------------------- builder
FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION} AS builder

WORKDIR /src
# Dependencies come from the script that the README and CI run, so that CI
# exercises the image's build steps. Copied alone, this layer stays cached until
# the script changes. Test-only packages are not needed here.
COPY scripts/install_deps.sh scripts/install_deps.sh
RUN ATTNSERVE_TEST_DEPS=0 bash scripts/install_deps.sh \
 && rm -rf /var/lib/apt/lists/*

# Only what the build reads (tests and benchmarks are off).
COPY CMakeLists.txt LICENSE ./
COPY cmake/ cmake/
COPY proto/ proto/
COPY common/ common/
COPY kernels/ kernels/
COPY server/ server/
COPY client/ client/

# The install tree is relocatable: bin/ and lib/ with an RPATH of $ORIGIN/../lib
# and every non-system shared library it needs bundled in lib/. cudart is
# linked statically, so the binaries need only the driver from CUDA.
ARG VCS_REF=unknown
RUN cmake -S . -B build -G Ninja \
      -DCMAKE_BUILD_TYPE=Release \
      -DATTNSERVE_GIT_COMMIT=${VCS_REF} \
      -DATTNSERVE_CUDA=ON \
      -DATTNSERVE_TESTS=OFF \
 && cmake --build build --parallel \
 && cmake --install build --prefix /opt/attnserve

# ---------------------------------------------------------------- builder-cpu
# The CPU-only build, on the distribution scripts/install_deps.sh and CI
# target. Its install tree bundles Debian 12's libraries and needs Debian 12's
# glibc (or newer) at run time.
FROM debian:${DEBIAN_VERSION} AS builder-cpu

WORKDIR /src
COPY scripts/install_deps.sh scripts/install_deps.sh
RUN ATTNSERVE_TEST_DEPS=0 bash scripts/install_deps.sh \
 && rm -rf /var/lib/apt/lists/*

COPY CMakeLists.txt LICENSE ./
COPY cmake/ cmake/
COPY proto/ proto/
COPY common/ common/
COPY kernels/ kernels/
COPY server/ server/
COPY client/ client/

ARG VCS_REF=unknown
RUN cmake -S . -B build -G Ninja \
      -DCMAKE_BUILD_TYPE=Release \
      -DATTNSERVE_GIT_COMMIT=${VCS_REF} \
      -DATTNSERVE_CUDA=OFF \
      -DATTNSERVE_TESTS=OFF \
 && cmake --build build --parallel \
 && cmake --install build --prefix /opt/attnserve

# ---------------------------------------------------------------- runtime-cpu
# `docker build --target runtime-cpu`: the CPU backend only, on Debian 12 slim,
# for clusters and laptops without GPUs (deploy/k8s/overlays/cpu).
FROM debian:${DEBIAN_VERSION}-slim AS runtime-cpu

ARG DEBIAN_VERSION
ARG ATTNSERVE_VERSION=0.2.0
ARG VCS_REF=unknown
ARG BUILD_DATE=unknown
LABEL org.opencontainers.image.title="attnserve" \
      org.opencontainers.image.description="Paged attention server, CPU backend only (gRPC, Prometheus metrics)" \
      org.opencontainers.image.version="${ATTNSERVE_VERSION}" \
      org.opencontainers.image.revision="${VCS_REF}" \
      org.opencontainers.image.created="${BUILD_DATE}" \
      org.opencontainers.image.base.name="debian:${DEBIAN_VERSION}-slim"

RUN --mount=type=bind,source=scripts/install_deps.sh,target=/tmp/install_deps.sh \
    bash /tmp/install_deps.sh --runtime \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 attnserve \
 && useradd --system --uid 10001 --gid 10001 --no-create-home \
      --home-dir /nonexistent --shell /usr/sbin/nologin attnserve

COPY --from=builder-cpu /opt/attnserve /opt/attnserve
ENV PATH=/opt/attnserve/bin:${PATH}

USER 10001:10001
EXPOSE 50051/tcp 9464/tcp
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
  CMD ["/opt/attnserve/bin/attnctl", "--target=127.0.0.1:50051", "--timeout_s=3", "health", "attnserve.v1.AttentionService"]
ENTRYPOINT ["/opt/attnserve/bin/attnserve", "--listen=0.0.0.0:50051", "--metrics_listen=0.0.0.0:9464"]
CMD []

# ---------------------------------------------------------------- runtime
# The default target, last so that `docker build .` builds it. The CUDA -base
# image suffices: cudart is static and every other library is bundled in the
# install tree, so nothing of the -runtime image's CUDA math libraries is used.
# The NVIDIA container toolkit injects the driver.
FROM nvidia/cuda:${CUDA_VERSION}-base-ubuntu${UBUNTU_VERSION} AS runtime

ARG CUDA_VERSION
ARG UBUNTU_VERSION
ARG ATTNSERVE_VERSION=0.2.0
ARG VCS_REF=unknown
ARG BUILD_DATE=unknown
LABEL org.opencontainers.image.title="attnserve" \
      org.opencontainers.image.description="GPU-resident paged attention server (gRPC, Prometheus metrics)" \
      org.opencontainers.image.version="${ATTNSERVE_VERSION}" \
      org.opencontainers.image.revision="${VCS_REF}" \
      org.opencontainers.image.created="${BUILD_DATE}" \
      org.opencontainers.image.base.name="nvidia/cuda:${CUDA_VERSION}-base-ubuntu${UBUNTU_VERSION}"

# Runtime packages through the same script (--runtime), mounted rather than
# copied so that it leaves nothing in the image. A numeric, non-root user so
# that Kubernetes' runAsNonRoot can verify it.
RUN --mount=type=bind,source=scripts/install_deps.sh,target=/tmp/install_deps.sh \
    bash /tmp/install_deps.sh --runtime \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 attnserve \
 && useradd --system --uid 10001 --gid 10001 --no-create-home \
      --home-dir /nonexistent --shell /usr/sbin/nologin attnserve

COPY --from=builder /opt/attnserve /opt/attnserve
ENV PATH=/opt/attnserve/bin:${PATH}

USER 10001:10001
# 50051: gRPC (attnserve.v1.AttentionService, grpc.health.v1, reflection).
# 9464: Prometheus /metrics.
EXPOSE 50051/tcp 9464/tcp

# Exits 0 only while the server reports SERVING (not while starting or draining).
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
  CMD ["/opt/attnserve/bin/attnctl", "--target=127.0.0.1:50051", "--timeout_s=3", "health", "attnserve.v1.AttentionService"]

# Inside a container the server listens on every interface; the flags given to
# `docker run` or by Kubernetes' args are appended.
ENTRYPOINT ["/opt/attnserve/bin/attnserve", "--listen=0.0.0.0:50051", "--metrics_listen=0.0.0.0:9464"]
CMD []
