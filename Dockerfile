# gpu-fraction-device-plugin node agent. Build: `docker build -t gpu-fraction-device-plugin:0.1.0 .`
# The NVIDIA container runtime brings the driver's NVML library and device nodes at run time
# (NVIDIA_VISIBLE_DEVICES=all in the DaemonSet), so the image carries no driver bits.

# Build stage: install the package and its dependencies into a self-contained venv.
FROM python:3.11-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/gpu-fraction
WORKDIR /src
# README.md* : the readme is optional for the build (pyproject names it; setuptools only warns).
COPY pyproject.toml README.md* ./
COPY deviceplugin ./deviceplugin
RUN /opt/gpu-fraction/bin/pip install --no-compile . \
 && /opt/gpu-fraction/bin/python -c "import deviceplugin.cli" \
 && test -x /opt/gpu-fraction/bin/gpu-fraction-plugin

# Run stage: the same base (same Python ABI), only the venv copied in.
FROM python:3.11-slim-bookworm
COPY --from=build /opt/gpu-fraction /opt/gpu-fraction
ENV PATH=/opt/gpu-fraction/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
# No USER: the plugin must run as root and privileged (it sets GPU compute modes, starts MPS
# control daemons for other pods and writes into the kubelet's and the runtime's host dirs),
# so a non-root user would only be overridden by the DaemonSet. See docs/deploy.md.
EXPOSE 9447
ENTRYPOINT ["gpu-fraction-plugin"]
CMD ["run"]
