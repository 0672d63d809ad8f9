"""Small LoRA adapters in PEFT's folder format, for the vLLM tier, written with numpy and safetensors (no
training, no torch, no hub).

The format, as PEFT's ``save_pretrained`` writes it and vLLM's LoRA loader reads it: a folder with
``adapter_config.json`` (``peft_type`` ``LORA``, ``r``, ``lora_alpha``, ``target_modules``, the base model)
and ``adapter_model.safetensors`` holding, per adapted linear layer ``W`` (torch shape ``[n_out, n_in]``),
``base_model.model.<W's module>.lora_A.weight`` (``[r, n_in]``) and ``...lora_B.weight`` (``[n_out, r]``);
the adapted weight is ``W + alpha / r * B @ A``.

``scale=0`` writes ``B = 0`` (what PEFT's own initialisation does): an adapter that loads and runs but
changes nothing, the control for "a non-zero adapter changes greedy output".  ``rank`` and ``n_in`` let
tests write the wrong adapters (a rank over the server's ``max_lora_rank``, shapes of another model).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

# the tiny Llama's linear layers (harness/tiny_model.py), as (module, n_out, n_in) per layer
ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    h = int(config["hidden_size"])
    inter = int(config["intermediate_size"])
    n_head = int(config["num_attention_heads"])
    n_kv = int(config["num_key_value_heads"])
    hd = int(config.get("head_dim") or h // n_head)
    return {"self_attn.q_proj": (n_head * hd, h), "self_attn.k_proj": (n_kv * hd, h),
            "self_attn.v_proj": (n_kv * hd, h), "self_attn.o_proj": (h, n_head * hd),
            "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h), "mlp.down_proj": (h, inter)}


def write_peft_lora(dest: Path, model_dir: Path, *, seed: int = 0, scale: float = 1.0, rank: int = 8,
                    alpha: float = 16.0, modules: Sequence[str] = ATTENTION + MLP,
                    n_in: int | None = None, with_weights: bool = True) -> Path:
    """Write a PEFT LoRA adapter of the model in ``model_dir`` (its ``config.json``) to the folder ``dest``.

    Entries of ``A`` and ``B`` have standard deviation ``1/sqrt(n_in)`` and ``scale/sqrt(rank)``, so the
    update ``alpha/r * B @ A`` is of the order of ``scale`` times the tiny model's weights' own scale
    (their std is 0.02, the update's about ``scale * 2 / sqrt(n_in)``): ``scale=1`` changes greedy output.
    ``n_in`` replaces every layer's input width (an adapter of another model); ``with_weights=False``
    leaves the weights file out."""
    import numpy as np
    from safetensors.numpy import save_file

    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    shapes = _shapes(config)
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for i in range(int(config["num_hidden_layers"])):
        for module in modules:
            n_out, width = shapes[module]
            width = n_in or width
            a = rng.standard_normal((rank, width)).astype(np.float32) / np.sqrt(width)
            b = rng.standard_normal((n_out, rank)).astype(np.float32) * (scale / np.sqrt(rank))
            prefix = f"base_model.model.model.layers.{i}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = a
            tensors[f"{prefix}.lora_B.weight"] = b
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules}),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "modules_to_save": None,
    }, indent=2) + "\n", encoding="utf-8")
    if with_weights:
        save_file(tensors, str(dest / "adapter_model.safetensors"), metadata={"format": "pt"})
    return dest
