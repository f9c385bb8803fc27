#!/usr/bin/env bash
# `make bench` on a GPU host: llmgate (one worker per GPU) against vLLM's own
# server, vllm-router over one `vllm serve` per GPU, the FastAPI batching
# baseline and vLLM in-process, on a small real model from this host's disk.
#
#   loadtest/gpu_bench.sh MODEL_DIR [bench flags...]   # on a host with 2+ GPUs
#   loadtest/gpu_bench.sh --dry-run [bench flags...]   # here, on CPU: the same steps, short
#
# MODEL_DIR is a Hugging Face model directory (config.json, tokenizer,
# safetensors), e.g. a copy of Qwen2.5-0.5B-Instruct; nothing is downloaded.
# It installs the CUDA build of vLLM (`LLMGATE_EXTRAS=gpu make install`),
# then runs every target one after the other with the model's own dtype and
# compiled engines (CUDA graphs), 128-token outputs: "-1" targets get GPU 0,
# "-2" targets GPUs 0 and 1. Results land in loadtest/results/<time>-bench/
# as for `make bench`. The dry run keeps this machine's CPU build and the
# embedded model, and runs each target for a few seconds, to check the steps.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "--dry-run" ]]; then
    shift
    make install
    exec .venv/bin/python -m loadtest.bench --targets all --long \
        --duration 5 --warmup 2 --users 8 "$@"
fi

model_dir="${1:?usage: loadtest/gpu_bench.sh MODEL_DIR [bench flags] | --dry-run}"
shift
[[ -f "$model_dir/config.json" ]] || { echo "no config.json in $model_dir" >&2; exit 2; }
command -v nvidia-smi >/dev/null || { echo "no nvidia-smi: not a GPU host (try --dry-run)" >&2; exit 2; }
LLMGATE_EXTRAS=gpu make install
exec .venv/bin/python -m loadtest.bench --targets all --long --no-enforce-eager \
    --model "$(cd "$model_dir" && pwd)" --dtype auto "$@"
