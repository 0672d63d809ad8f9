"""Small LoRA adapters in llama.cpp's GGUF format, for tests and benchmarks, written with the ``gguf``
package (no training, no torch).

The format, as llama.cpp's ``convert_lora_to_gguf.py`` writes it and ``llama_adapter_lora_init`` reads
it: ``general.type = "adapter"``, ``adapter.type = "lora"``, ``adapter.lora.alpha``, the base model's
``general.architecture``, and per adapted weight ``W`` (ggml shape ``[n_in, n_out]``) two tensors
``<W>.lora_a`` (ggml ``[n_in, r]``) and ``<W>.lora_b`` (ggml ``[r, n_out]``); the adapted weight is
``W + scale * alpha / r * B @ A``.  numpy shapes are ggml's reversed.  SmolLM2-135M's query projection
is 576 x 576 in each of its 30 layers.

Tensors are F16 (convert_lora_to_gguf.py's default), or F32 with ``f32=True`` (served the same).

``scale=0`` writes ``B = 0``: an adapter that loads and runs but changes nothing (the control for "a
non-zero adapter changes greedy output").
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import openai

SMOLLM2_LAYERS = 30
SMOLLM2_HIDDEN = 576


def write_lora_gguf(path: Path, *, seed: int = 0, scale: float = 1.0, rank: int = 8, alpha: float = 16.0,
                    layers: int = SMOLLM2_LAYERS, n_in: int = SMOLLM2_HIDDEN, n_out: int = SMOLLM2_HIDDEN,
                    arch: str = "llama", file_type: str = "adapter", tensor: str = "attn_q",
                    f32: bool = False) -> Path:
    """Write a LoRA adapter of the ``tensor`` projection of every layer to ``path`` (returned).

    ``arch``, ``file_type`` and ``n_in``/``n_out`` let tests write the wrong adapters: another
    architecture, a GGUF that is not an adapter, shapes that fit another model."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    dtype = np.float32 if f32 else np.float16
    w = gguf.GGUFWriter(str(path), arch)
    w.add_string("general.type", file_type)
    w.add_string("general.name", path.stem)
    if file_type == "adapter":
        w.add_string("adapter.type", "lora")
        w.add_float32("adapter.lora.alpha", alpha)
    for i in range(layers):
        a = rng.standard_normal((rank, n_in)).astype(np.float32) / np.sqrt(n_in)
        b = (rng.standard_normal((n_out, rank)).astype(np.float32) * scale / np.sqrt(rank))
        w.add_tensor(f"blk.{i}.{tensor}.weight.lora_a", a.astype(dtype))
        w.add_tensor(f"blk.{i}.{tensor}.weight.lora_b", b.astype(dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


LORA_PROMPT = "What is 2+2?"


def lora_answer(client: "openai.OpenAI", model: str) -> str:
    """The greedy answer of ``model`` (a base model or an adapter) to :data:`LORA_PROMPT`: adapters from
    :func:`write_lora_gguf` with ``scale=1`` change it, so it tells which weights answered."""
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": LORA_PROMPT}],
                                       max_tokens=10, temperature=0)
    return r.choices[0].message.content or ""
