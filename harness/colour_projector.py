"""A closed-form vision projector for SmolLM2-135M, for tests and benchmarks: an mmproj GGUF that llama.cpp's
mtmd loads like a LLaVA projector, and whose image tokens are the text model's own embeddings of colour words.

No trained vision model fits on this machine (nothing on the package registries ships one), so this one is
computed, not trained, and its answers are checkable: a solid red image becomes sixteen input embeddings of
" red", and SmolLM2 asked "What colour is this image? Answer with one word." says "Red".

The graph llama.cpp runs for ``clip.projector_type = mlp`` (the LLaVA graph), and what each part does here:

- preprocessing: the image is padded to a square and resized to ``clip.vision.image_size`` (64), then
  normalised with ``image_mean`` 0 and ``image_std`` 1, so channels are in [0, 1];
- patch embedding: a 16x16 convolution with stride 16 (4 x 4 = 16 patches, so 16 image tokens) whose kernel
  averages each colour channel: the first three features of a patch are its mean R, G and B, the rest 0;
- position embeddings are zero; ``block_count`` 1 means no ViT layer runs (the LLaVA graph stops at the
  second-to-last layer), though the loader wants that one layer's tensors, so they are present and unused;
- ``mm.0`` -> GELU -> ``mm.2``: for each corner ``c`` of the RGB cube, ``score_c(x) = sum_i (x_i if c_i
  else 1 - x_i)`` is 3 at the corner and at most 2 at every other corner.  Two hidden units per corner,
  ``gelu(A (score - 2.5))`` and ``gelu(A (score - 2.5) - B)``, differ by about ``B`` near the corner and by
  about 0 away from it, so ``(h1 - h2) / B`` is a soft indicator (1 from ``score >= 2.7``, 0 below
  ``score <= 2.4``); ``mm.2`` maps it to the corner's colour-word embedding (dequantised from the GGUF's
  ``token_embd.weight``).  A patch between corners gives a zero embedding.

It builds in well under a second (numpy + ``gguf``); tests cache it per session.
"""

from __future__ import annotations

from pathlib import Path

IMAGE_SIZE = 64
PATCH = 16
N_IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2
COLOURS: dict[str, tuple[int, int, int]] = {
    "black": (0, 0, 0), "red": (1, 0, 0), "green": (0, 1, 0), "blue": (0, 0, 1),
    "yellow": (1, 1, 0), "purple": (1, 0, 1), "cyan": (0, 1, 1), "white": (1, 1, 1),
}
# the colours SmolLM2-135M (Q4_1) names at temperature 0 from this projector (blue, purple and cyan it
# does not: the model, not the projector)
NAMED = ("red", "green", "yellow", "white", "black")
QUESTION = "What colour is this image? Answer with one word."
_N_EMBD = 8  # the vision width: 3 features used, the rest zero
_A = 50.0
_B = 10.0


def _word_embeddings(text_gguf: Path) -> dict[str, object]:
    """Each colour word's input embedding (``" red"`` etc., one token each in SmolLM2's vocabulary)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(text_gguf))
    tokens = reader.fields["tokenizer.ggml.tokens"]
    vocab = {bytes(tokens.parts[i]).decode("utf-8", "replace"): n for n, i in enumerate(tokens.data)}
    table = next(t for t in reader.tensors if t.name == "token_embd.weight")
    emb = gguf.quants.dequantize(table.data, table.tensor_type).astype(np.float32)
    out: dict[str, object] = {}
    for word in COLOURS:
        tok = "Ġ" + word  # byte-level BPE spells the leading space as 'Ġ'
        if tok not in vocab:
            raise ValueError(f"{text_gguf.name}: {tok!r} is not one token")
        out[word] = emb[vocab[tok]]
    return out


def write_colour_projector(path: Path, text_gguf: Path) -> Path:
    """Write the projector for the text model ``text_gguf`` to ``path`` (returned)."""
    import gguf
    import numpy as np

    words = _word_embeddings(text_gguf)
    n_text = len(next(iter(words.values())))  # type: ignore[arg-type]
    f32 = np.float32
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_string("general.name", "colour-projector")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.has_text_encoder", False)
    w.add_bool("clip.has_llava_projector", True)
    w.add_string("clip.projector_type", "mlp")
    w.add_bool("clip.use_gelu", True)
    w.add_uint32("clip.vision.image_size", IMAGE_SIZE)
    w.add_uint32("clip.vision.patch_size", PATCH)
    w.add_uint32("clip.vision.embedding_length", _N_EMBD)
    w.add_uint32("clip.vision.feed_forward_length", _N_EMBD)
    w.add_uint32("clip.vision.projection_dim", n_text)
    w.add_uint32("clip.vision.block_count", 1)
    w.add_uint32("clip.vision.attention.head_count", 1)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_array("clip.vision.image_mean", [0.0, 0.0, 0.0])
    w.add_array("clip.vision.image_std", [1.0, 1.0, 1.0])

    kernel = np.zeros((_N_EMBD, 3, PATCH, PATCH), f32)  # torch Conv2d layout [out, in, kh, kw]
    for c in range(3):
        kernel[c, c] = 1.0 / (PATCH * PATCH)
    w.add_tensor("v.patch_embd.weight", kernel)
    w.add_tensor("v.patch_embd.bias", np.zeros(_N_EMBD, f32))
    w.add_tensor("v.position_embd.weight", np.zeros((N_IMAGE_TOKENS, _N_EMBD), f32))
    zero_sq = np.zeros((_N_EMBD, _N_EMBD), f32)
    for name in ("attn_q", "attn_k", "attn_v", "attn_out", "ffn_up", "ffn_down"):
        w.add_tensor(f"v.blk.0.{name}.weight", zero_sq)
        w.add_tensor(f"v.blk.0.{name}.bias", np.zeros(_N_EMBD, f32))
    for name in ("ln1", "ln2"):
        w.add_tensor(f"v.blk.0.{name}.weight", np.ones(_N_EMBD, f32))
        w.add_tensor(f"v.blk.0.{name}.bias", np.zeros(_N_EMBD, f32))

    hidden = 2 * len(COLOURS)
    w0 = np.zeros((hidden, _N_EMBD), f32)  # torch Linear layout [out, in]
    b0 = np.zeros(hidden, f32)
    w2 = np.zeros((n_text, hidden), f32)
    for k, (word, corner) in enumerate(COLOURS.items()):
        sign = np.array([1.0 if c else -1.0 for c in corner], f32)
        const = float(sum(1 for c in corner if not c))  # score = sign . x + const
        for j, shift in enumerate((0.0, _B)):
            w0[2 * k + j, :3] = _A * sign
            b0[2 * k + j] = _A * (const - 2.5) - shift
        e = np.asarray(words[word], f32)
        w2[:, 2 * k] = e / _B
        w2[:, 2 * k + 1] = -e / _B
    w.add_tensor("mm.0.weight", w0)
    w.add_tensor("mm.0.bias", b0)
    w.add_tensor("mm.2.weight", w2)
    w.add_tensor("mm.2.bias", np.zeros(n_text, f32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def solid_png(rgb: tuple[int, int, int], size: tuple[int, int] = (64, 64), *, noise: int = 0,
              seed: int = 0, fmt: str = "PNG") -> bytes:
    """An image of one colour (``noise``: each pixel channel moved by up to that much, clipped), encoded."""
    import io

    import numpy as np
    from PIL import Image

    w, h = size
    px = np.empty((h, w, 3), np.int16)
    px[:] = rgb
    if noise:
        px += np.random.default_rng(seed).integers(-noise, noise + 1, size=px.shape, dtype=np.int16)
    img = Image.fromarray(np.clip(px, 0, 255).astype(np.uint8), "RGB")
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()
