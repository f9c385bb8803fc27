"""A LoRA adapter for the embedded model, made on the spot (no hub): its B
matrices are zero, so it answers as the base model does, which is what the
tests need to check that a pool serves an adapter as a model of its own."""

from __future__ import annotations

import json
from pathlib import Path

RANK = 8


def write_zero_lora(directory: Path, model_dir: str) -> Path:
    """A PEFT-format LoRA adapter (q_proj and v_proj of every layer) in ``directory``."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    outputs = {"q_proj": hidden, "v_proj": config["num_key_value_heads"] * head_dim}
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, out_features in outputs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (
                torch.randn(RANK, hidden, generator=generator) * 0.01
            )
            tensors[f"{prefix}.lora_B.weight"] = torch.zeros(out_features, RANK)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": model_dir,
        "r": RANK,
        "lora_alpha": RANK,
        "lora_dropout": 0.0,
        "target_modules": list(outputs),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    (directory / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return directory
