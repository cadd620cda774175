# One image for every Noctaya program; the command picks which one runs:
#   python -m hooks serve        Metacontroller hook server (default)
#   python -m gateway            the per-LLMService gateway (in-process scaler when alone)
#   python -m scaler aggregate   the aggregate scaler of a multi-gateway LLMService
#   python -m prewarm hub|wait   the prewarm Job's downloader, the serving Pod's cache-marker wait
# The manifests under metacontroller/ and the children the hooks render set `command` explicitly.
#
#   docker build -t ghcr.io/noctaya/noctaya:0.2.0 .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# Every runtime dependency ships manylinux wheels, so no compiler is needed even here;
# --only-binary makes a missing wheel fail the build instead of silently compiling.
COPY requirements.txt /tmp/requirements.txt
RUN python -m venv /opt/noctaya \
 && /opt/noctaya/bin/pip install --only-binary=:all: -r /tmp/requirements.txt \
 && /opt/noctaya/bin/pip uninstall -y pip setuptools wheel || true
COPY hooks /app/hooks
COPY gateway /app/gateway
COPY scaler /app/scaler
COPY prewarm /app/prewarm
# Byte-compile now: the running containers have a read-only root filesystem.
RUN /opt/noctaya/bin/python -m compileall -q /app /opt/noctaya/lib

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="noctaya" \
      org.opencontainers.image.description="Noctaya: Metacontroller hooks, OpenAI-compatible gateway and KEDA external-push scaler"
COPY --from=build /opt/noctaya /opt/noctaya
COPY --from=build /app /app
ENV PATH=/opt/noctaya/bin:$PATH \
    PYTHONPATH=/app \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
WORKDIR /app
# Non-root (the same uid as distroless "nonroot"); manifests also set runAsNonRoot.
USER 65532:65532
EXPOSE 8080 9090 9091
ENTRYPOINT ["python", "-m"]
CMD ["hooks", "serve"]
