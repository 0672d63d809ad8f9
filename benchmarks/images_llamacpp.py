#!/usr/bin/env python3
"""Images through ``out=llamacpp --mmproj``: the encoder's throughput, and what an image costs a request.

    .venv/bin/python -m benchmarks.images_llamacpp [--repeat 9]

With SmolLM2-135M (Q4_1) and the closed-form colour projector (harness/colour_projector.py: one conv and a
two-layer MLP, 16 image tokens; a real projector such as SmolVLM's SigLIP is a ViT and costs far more
per image, so read the encoder figures as the pipeline's floor, not a vision model's speed):

1. in process, on one thread each time: ``mtmd_encode_chunk`` alone (the projector's graph), and the
   scheduler's whole evaluation of an image (encode, then decode its embeddings into a sequence's KV
   cache): image tokens per second;
2. through ``dynamo-run in=http``: time to first token (streamed, temperature 0) of a chat with one new
   image, of the same chat with the image left out, and of a repeat of an image request (a prefix-cache
   hit past the image), interleaved, each request made unique by a nonce at the start of its text so
   only the repeat hits the cache; median and min-max over the repeats, and the cached tokens reported.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from harness.colour_projector import QUESTION, solid_png, write_colour_projector
from harness.proc import DynamoRun
from harness.smollm2 import smollm2_gguf_or_exit


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):8.1f} ({min(xs):.1f}-{max(xs):.1f})"


def encoder(gguf: Path, proj: Path, repeat: int) -> None:
    from dynamo.engines.llamacpp import model
    from dynamo.engines.llamacpp.vision import ImageSpan, Projector

    llama = model.load(gguf, n_parallel=1, n_ctx_seq=512, n_batch=512, n_ubatch=512, n_gpu_layers=0, threads=1,
                       threads_batch=1, type_k=None, type_v=None, flash_attn=None, verbose=False)
    projector = Projector(proj, llama.model, threads=1, verbose=False)
    M = projector.M
    try:
        chunks = projector.tokenize(solid_png((200, 30, 30), (64, 64), noise=20))
        image = next(c for c in chunks.items() if M.mtmd_input_chunk_get_type(c) == M.MTMD_INPUT_CHUNK_TYPE_IMAGE)
        n = chunks.n_pos
        enc, full = [], []
        for _ in range(repeat):
            t = time.perf_counter()
            assert M.mtmd_encode_chunk(projector.ctx, image) == 0
            enc.append(1e3 * (time.perf_counter() - t))
            llama.L.llama_memory_seq_rm(llama.mem, 0, -1, -1)
            t = time.perf_counter()
            assert projector.evaluate(llama.lctx, ImageSpan(0, n, chunks), 0, 512) == 0
            full.append(1e3 * (time.perf_counter() - t))
        print(f"image of {n} tokens, 1 thread, {repeat} repeats: median ms (min-max)")
        print(f"  encode only         {_spread(enc)}  -> {1e3 * n / statistics.median(enc):9.0f} image tokens/s")
        print(f"  encode + decode KV  {_spread(full)}  -> {1e3 * n / statistics.median(full):9.0f} image tokens/s")
    finally:
        del chunks, image
        projector.free()
        model.free(llama)


def _url(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(solid_png((220, 40, 40), (64, 64), noise=20, seed=seed)).decode()


def _ttft(client: httpx.Client, content: list[dict]) -> tuple[float, int]:
    body = {"model": "m", "temperature": 0, "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": content}]}
    t = time.perf_counter()
    first, cached = None, 0
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if first is None and '"content"' in line:
                first = 1e3 * (time.perf_counter() - t)
            if '"cached_tokens"' in line:
                usage = json.loads(line[len("data: "):])["usage"]
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert first is not None
    return first, cached


def serving(gguf: Path, proj: Path, repeat: int) -> None:
    with DynamoRun("out=llamacpp", str(gguf), "--mmproj", str(proj), "--model-name", "m", "--context-length", "512",
                   startup_timeout=180) as srv, httpx.Client(base_url=srv.base_url, timeout=60) as client:
        rows: dict[str, list[float]] = {"text only": [], "1 new image": [], "same image again": []}
        cached: dict[str, list[int]] = {k: [] for k in rows}
        _ttft(client, [{"type": "text", "text": "warm up"}])
        for i in range(repeat):
            nonce = {"type": "text", "text": f"Request {os.getpid()}-{i}."}
            image = {"type": "image_url", "image_url": {"url": _url(i)}}
            question = {"type": "text", "text": QUESTION}
            for name, content in (("text only", [nonce, question]), ("1 new image", [nonce, image, question]),
                                  ("same image again", [nonce, image, question])):
                t, c = _ttft(client, content)
                rows[name].append(t)
                cached[name].append(c)
        print(f"TTFT through in=http, {repeat} interleaved repeats: median ms (min-max), cached prompt tokens")
        for name, xs in rows.items():
            print(f"  {name:<18}{_spread(xs)}   cached {statistics.median(cached[name]):.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=9)
    args = ap.parse_args()
    gguf = smollm2_gguf_or_exit()
    with tempfile.TemporaryDirectory() as d:
        proj = write_colour_projector(Path(d) / "colour-mmproj.gguf", gguf)
        print(f"load average {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} CPUs")
        encoder(gguf, proj, args.repeat)
        serving(gguf, proj, args.repeat)
        print(f"load average {os.getloadavg()[0]:.2f} (1 min)")


if __name__ == "__main__":
    main()
