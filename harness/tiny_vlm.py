"""A tiny, randomly initialised vision-language model folder that vLLM serves on CPU, built offline.

No hub access and no small trained vision model on the package registries, so the vLLM tier builds one:
Idefics3 (SmolVLM's architecture: a SigLIP vision tower, a pixel-shuffle connector, a Llama text model),
whose vLLM code and transformers' PIL image processor need no torchvision (the CPU venv has none: the
PyPI torchvision wheels are CUDA builds whose ``_C.so`` needs ``libc10_cuda.so``, so ``import
torchvision`` fails against torch's CPU build; LLaVA, Qwen2-VL, Gemma 3 and the other vLLM models whose
modules import transformers' torchvision-backed processors fail to import).

Shape: the tokenizer and ChatML template of harness/tiny_model.py plus Idefics3's special tokens; a
one-layer vision tower of width 64 over 64x64 images in 16x16 patches; scale factor 2, so an image is 4
image tokens (7 positions with its ``<fake_token_around_image>`` and ``<global-img>`` wrappers); no image
splitting (a 64-pixel longest edge); a 2-layer, 64-wide Llama (head size 32, which vLLM's CPU attention
supports).  Random weights from a fixed seed: it proves that images reach the model (two pictures give
two answers, the same picture the same answer), never that it understands them.

Needs torch and transformers, so only the vLLM tier (``.venv-vllm``) builds it.
"""

from __future__ import annotations

from pathlib import Path

from harness.tiny_model import build_tiny_hf_model

__all__ = ["IMAGE_SIZE", "build_tiny_vlm"]

IMAGE_SIZE = 64
_PATCH = 16
_SCALE = 2
_SEED = 1234


def build_tiny_vlm(dest: Path, name: str = "tiny-vlm") -> Path:
    """Create ``dest / name`` (config, safetensors, tokenizer, processor, chat template) and return it."""
    import torch
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        PreTrainedTokenizerFast,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    base = build_tiny_hf_model(Path(dest), name=f"{name}-text", with_weights=False)
    tok = PreTrainedTokenizerFast.from_pretrained(base)
    specials = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
    specials += [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    tok.add_special_tokens({"additional_special_tokens": specials})
    text = dict(model_type="llama", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                max_position_embeddings=2048, tie_word_embeddings=False, pad_token_id=0,
                bos_token_id=1, eos_token_id=2)
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                  image_size=IMAGE_SIZE, patch_size=_PATCH)
    config = Idefics3Config(vision_config=vision, text_config=text, scale_factor=_SCALE, pad_token_id=0,
                            image_token_id=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)
    torch.manual_seed(_SEED)
    folder = Path(dest) / name
    Idefics3ForConditionalGeneration(config).save_pretrained(folder)
    images = Idefics3ImageProcessorPil(size={"longest_edge": IMAGE_SIZE}, max_image_size={"longest_edge": IMAGE_SIZE},
                                       do_image_splitting=False)
    seq_len = (IMAGE_SIZE // _PATCH) ** 2 // _SCALE ** 2
    Idefics3Processor(images, tok, image_seq_len=seq_len, chat_template=tok.chat_template).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
