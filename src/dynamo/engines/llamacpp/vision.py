"""Images for ``out=llamacpp --mmproj``: llama.cpp's multimodal library (mtmd) turns an image into the
chunks a prompt evaluates, and the scheduler evaluates them in its own slots.

How an image lives in a prompt.  The frontend (llm/image_prompt.py) puts a run of placeholder ids where the
image goes: ``image_tokens`` ids (the count the card announced), each carrying half of the image's 64-bit
``mm_hash`` (kv/hashing.py sees them as ordinary u32 ids).  Here that run is checked against what mtmd
makes of the image (``tokenize``: the image's own chunks, text chunks included for projectors that wrap an
image in marker tokens, and their positions); if the counts differ (a projector that tiles by image size),
the run is rewritten to the real count.  So the prompt the slots cache, copy, offload and name blocks with
has one id per KV position, and an image's ids are its content: two prompts with different images part
at the image, the same image is a prefix hit.

Evaluation (``evaluate``) runs on the scheduler thread: mtmd encodes the image (the projector's graph) and
decodes its embeddings into the slot's sequence at the slot's position (``mtmd_helper_eval_chunk_single``,
which also switches to non-causal attention where a model wants it).  An image is evaluated whole, so a
cached prefix that ends inside an image is cut back to the image's start.

Projectors whose models use M-RoPE (Qwen2-VL and later) give an image fewer positions than embeddings; the
slots assume one position per id, so they are refused at load.
"""

from __future__ import annotations

import ctypes
import io
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynamo.engines.llamacpp.model import silence_llama_log
from dynamo.errors import ModelError, RequestError
from dynamo.llm.image_prompt import placeholder_ids


class ImageChunks:
    """One image as mtmd tokenized it; freed when the last reference goes (the request and the scheduler
    hold it)."""

    def __init__(self, M: Any, chunks: Any):
        self._M = M
        self.chunks = chunks
        self.n_pos = int(M.mtmd_helper_get_n_pos(chunks))

    def items(self) -> list[Any]:
        M = self._M
        return [M.mtmd_input_chunks_get(self.chunks, i) for i in range(M.mtmd_input_chunks_size(self.chunks))]

    def __del__(self) -> None:
        if self.chunks:
            self._M.mtmd_input_chunks_free(self.chunks)
            self.chunks = None


@dataclass
class ImageSpan:
    """Where an image sits in a request's prompt: ``offset`` and ``length`` (its positions)."""

    offset: int
    length: int
    chunks: ImageChunks


class Projector:
    """An mmproj GGUF loaded against the text model (on the loading thread)."""

    def __init__(self, path: Path, model: Any, *, threads: int, verbose: bool, use_gpu: bool = False):
        from llama_cpp import mtmd_cpp as M

        self.M = M
        self.path = path
        if not path.is_file():
            raise ModelError(f"--mmproj {path}: no such file")
        if not verbose:
            import llama_cpp

            quiet = silence_llama_log(llama_cpp)
            M.mtmd_log_set(quiet, ctypes.c_void_p(0))
            M.mtmd_helper_log_set(quiet, ctypes.c_void_p(0))
        params = M.mtmd_context_params_default()
        params.use_gpu = use_gpu  # with the text model's layers offloaded (n_gpu_layers), the encoder too
        params.n_threads = threads
        params.print_timings = verbose
        params.warmup = False
        ctx = M.mtmd_init_from_file(str(path).encode(), model, params)
        if not ctx:
            raise ModelError(f"--mmproj {path}: llama.cpp cannot load it as a projector of this model (not an "
                             "mmproj GGUF, or made for a model of another width; -v shows llama.cpp's log)")
        self.ctx = ctx
        if not M.mtmd_support_vision(ctx):
            self.free()
            raise ModelError(f"--mmproj {path}: this projector takes no images (audio only)")
        if M.mtmd_decode_use_mrope(ctx):
            self.free()
            raise ModelError(f"--mmproj {path}: its model places image tokens with M-RoPE (Qwen2-VL and later), "
                             "which out=llamacpp's scheduler does not do")
        # tokenizing (image preprocessing, in the event loop's worker threads) and evaluating (the scheduler
        # thread) take turns on the projector's context
        self._lock = threading.Lock()
        self.image_tokens = self.tokenize(_probe_png()).n_pos

    def free(self) -> None:
        if self.ctx:
            self.M.mtmd_free(self.ctx)
            self.ctx = None

    def tokenize(self, data: bytes) -> ImageChunks:
        """The image's chunks (RequestError: not an image llama.cpp can use)."""
        import numpy as np
        from PIL import Image

        M = self.M
        try:
            with Image.open(io.BytesIO(data)) as img:
                img.seek(0)
                rgb = np.ascontiguousarray(np.asarray(img.convert("RGB"), dtype=np.uint8))
        except Exception as e:  # noqa: BLE001 - Pillow raises many kinds for a bad file
            raise RequestError(f"The image cannot be decoded ({e})", param="messages") from None
        h, w = rgb.shape[:2]
        buf = rgb.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        marker = (M.mtmd_get_marker(self.ctx) or M.mtmd_default_marker())
        text = M.mtmd_input_text(text=marker, text_len=len(marker), add_special=False, parse_special=False)
        with self._lock:
            bitmap = M.mtmd_bitmap_init(w, h, buf)
            if not bitmap:
                raise RequestError(f"The image ({w}x{h}) cannot be used", param="messages")
            chunks = M.mtmd_input_chunks_init()
            try:
                bitmaps = (M.mtmd_bitmap_p_ctypes * 1)(bitmap)
                rc = M.mtmd_tokenize(self.ctx, chunks, ctypes.byref(text), bitmaps, 1)
            finally:
                M.mtmd_bitmap_free(bitmap)
            if rc != 0:
                M.mtmd_input_chunks_free(chunks)
                raise RequestError(f"llama.cpp cannot preprocess the image ({w}x{h}; error {rc})", param="messages")
        return ImageChunks(M, chunks)

    def evaluate(self, lctx: Any, span: ImageSpan, seq_id: int, n_batch: int) -> int:
        """Encode the image and decode it into sequence ``seq_id`` from position ``span.offset`` (the
        scheduler thread); 0 on success, else llama.cpp's error code."""
        M = self.M
        n_past = span.offset
        new_n_past = ctypes.c_int32(0)
        with self._lock:  # (tokenizing and encoding share the projector's context)
            for chunk in span.chunks.items():
                rc = M.mtmd_helper_eval_chunk_single(self.ctx, lctx, chunk, n_past, seq_id, n_batch, False,
                                                     ctypes.byref(new_n_past))
                if rc != 0:
                    return int(rc)
                n_past = new_n_past.value
        return 0


def _probe_png() -> bytes:
    """A small grey image: what an image costs in positions, for the model card."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (128, 128, 128)).save(buf, format="PNG")
    return buf.getvalue()


def expand(prompt: list[int], images: list[Any], projector: Projector) -> tuple[list[int], list[ImageSpan]]:
    """The prompt with each image's placeholder run at its real length, and the images' spans (a thread:
    the images are decoded and preprocessed).  ``images`` are the request's ``ImageInput`` items."""
    out: list[int] = []
    spans: list[ImageSpan] = []
    at = 0
    for item in sorted(images, key=lambda i: i.offset):
        if item.offset < at or item.offset + item.length > len(prompt) or item.length < 1:
            raise RequestError("image placeholders out of place in the prompt", param="messages")
        chunks = projector.tokenize(item.data)
        out.extend(prompt[at:item.offset])
        spans.append(ImageSpan(len(out), chunks.n_pos, chunks))
        out.extend(placeholder_ids(item.mm_hash, chunks.n_pos))
        at = item.offset + item.length
    out.extend(prompt[at:])
    if spans and spans[-1].offset + spans[-1].length == len(out):
        raise RequestError("the prompt ends with an image: text must follow it", param="messages")
    return out, spans


def cut_before_images(keep: int, spans: list[ImageSpan]) -> int:
    """``keep`` cached positions, cut back to an image's start when it ends inside that image."""
    for span in spans:
        if span.offset < keep < span.offset + span.length:
            return span.offset
    return keep
