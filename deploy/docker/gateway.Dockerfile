# syntax=docker/dockerfile:1
# The gateway image: the OpenAI HTTP API and the ZeroMQ pool, nothing else.
# No vLLM, no torch: llmgate's base dependencies only (FastAPI, uvicorn, pyzmq,
# msgspec, prometheus-client, psutil).
#
#   docker build -f deploy/docker/gateway.Dockerfile -t llmgate/gateway .
#   docker run -p 8000:8000 -e LLMGATE_WORKERS=tcp://gpu1:5550 llmgate/gateway
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# -- build: a virtualenv with llmgate and its base dependencies ----------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/venv
COPY pyproject.toml README.md /src/
COPY shared /src/shared
COPY gateway /src/gateway
# No extra ([cpu]/[gpu]) is named, so vLLM and torch stay out; fail the build
# if a future dependency drags them in anyway.
RUN /opt/venv/bin/pip install "/src[tracing]" \
    && /opt/venv/bin/python -c "import gateway.main, gateway.app" \
    && if /opt/venv/bin/python -c "import torch" 2>/dev/null; then \
         echo "torch leaked into the gateway image" >&2; exit 1; fi \
    && if /opt/venv/bin/python -c "import vllm" 2>/dev/null; then \
         echo "vllm leaked into the gateway image" >&2; exit 1; fi

# -- runtime -------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
# tini as PID 1: forwards SIGTERM (the gateway drains on it) and reaps the
# processes uvicorn starts with --processes N.
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin llmgate \
    && install -d -o 10001 -g 10001 /var/lib/llmgate
COPY --from=build /opt/venv /opt/venv
COPY deploy/docker/healthcheck.py /opt/llmgate/healthcheck.py
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    LLMGATE_HOST=0.0.0.0 \
    LLMGATE_PORT=8000 \
    LLMGATE_STATE_DIR=/var/lib/llmgate
USER 10001:10001
WORKDIR /home/llmgate
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "/opt/llmgate/healthcheck.py", "gateway"]
ENTRYPOINT ["tini", "--", "llmgate", "gateway"]
