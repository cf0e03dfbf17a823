# gpu-fraction-device-plugin node agent, built with no registry: `make image` (hack/image/build.sh)
# bootstraps BASE from Debian's packages, writes the wheels this file copies, then builds it with
# podman (--network=none). The NVIDIA container runtime brings the driver's NVML library
# (libnvidia-ml.so.1) and the device nodes at run time (NVIDIA_VISIBLE_DEVICES=all below and in
# the DaemonSet), so the image carries no driver bits.

# Debian's essential packages plus python3, mount and libstdc++6, imported with `podman import`.
ARG BASE=localhost/gpu-fraction/base:bookworm

# Dependencies: a venv without pip, filled from wheels only (no index, no compiler); pip runs
# from its own wheel, so it never lands in the image. One layer, rebuilt only when the pins do.
FROM ${BASE} AS deps
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_INDEX=1
RUN python3 -m venv --without-pip /opt/gpu-fraction
COPY build/image/wheels/tools/ /wheels/tools/
COPY build/image/wheels/deps/ /wheels/deps/
# --no-compile, then bytecode for what the plugin imports only (below). kubernetes.aio goes: an
# asyncio copy of the whole API client (~70 MB) that nothing imports (the plugin uses
# kubernetes.client and kubernetes.config, in deviceplugin/kube/client.py; tests/test_image.py
# checks). The .pth puts the app's own directory (next stage) on the venv's path.
RUN pip=$(echo /wheels/tools/pip-*.whl) \
 && /opt/gpu-fraction/bin/python "$pip/pip" install --quiet --no-compile \
      --find-links /wheels/deps --only-binary=:all: -r /wheels/deps/requirements.txt \
 && site=/opt/gpu-fraction/lib/python3.11/site-packages \
 && rm -r $site/kubernetes/aio \
 && echo /opt/gpu-fraction-app > $site/gpu-fraction-app.pth \
 && /opt/gpu-fraction/bin/python -c "from kubernetes import client, config; import grpc, \
      google.protobuf, pynvml, watchdog.observers, yaml, prometheus_client"

# The app alone, in a directory of its own: a code change rebuilds this small layer only.
FROM deps AS app
COPY build/image/wheels/app/ /wheels/app/
# The import check fails the build on a library the base lacks (libstdc++6 for grpcio was one).
RUN pip=$(echo /wheels/tools/pip-*.whl) \
 && /opt/gpu-fraction/bin/python "$pip/pip" install --quiet --no-deps \
      --target /opt/gpu-fraction-app /wheels/app/*.whl \
 && /opt/gpu-fraction-app/bin/gpu-fraction-plugin --version \
 && /opt/gpu-fraction/bin/python -c "import deviceplugin.daemon.lifecycle, deviceplugin.dra.plugin"

# Run stage: the same base (same Python), the two directories copied in, no wheels, no pip.
FROM ${BASE}
ARG VERSION=0.1.0
COPY --from=deps /opt/gpu-fraction /opt/gpu-fraction
COPY --from=app /opt/gpu-fraction-app /opt/gpu-fraction-app
ENV PATH=/opt/gpu-fraction-app/bin:/opt/gpu-fraction/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
LABEL org.opencontainers.image.title=gpu-fraction-device-plugin \
      org.opencontainers.image.version=${VERSION} \
      org.opencontainers.image.licenses=Apache-2.0
# No USER: the plugin must run as root and privileged (it sets GPU compute modes, starts MPS
# control daemons for other pods and writes into the kubelet's and the runtime's host dirs),
# so a non-root user would only be overridden by the DaemonSet. See docs/deploy.md.
EXPOSE 9447
ENTRYPOINT ["gpu-fraction-plugin"]
CMD ["run"]
