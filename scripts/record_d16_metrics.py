"""Record Dynamo 1.6.1's own /metrics (frontend and a mocker worker) as the test data of
tests/unit/metrics/test_metrics_1x_names.py.

    DYN16_PYTHON=/path/to/.venv-dynamo1x/bin/python .venv/bin/python scripts/record_d16_metrics.py

Starts 1.6.1's frontend (``--router-mode kv --migration-limit 1``) and two 1.6.1 mockers on a file store,
sends unary and streamed requests, kills the mocker serving a long stream mid-way (a migration), then
writes both scrapes to tests/unit/metrics/data/.  1.6.1 reads DYN_SYSTEM_PORT as an i16: the worker ports
are taken below 32768.
"""

from __future__ import annotations

import random
import socket
import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.dynamo1x import build_tiny_chat_5k, d16_env, d16_frontend, d16_mocker  # noqa: E402

OUT = ROOT / "tests" / "unit" / "metrics" / "data"


def low_port() -> int:
    while True:
        port = random.randint(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue


def inflight(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("dynamo_component_inflight_requests{"))


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        store.mkdir()
        model = build_tiny_chat_5k(Path(tmp) / "models")
        ports = [low_port(), low_port()]
        mockers = [d16_mocker(model, "dyn://ns.backend.generate", d16_env(store, {"DYN_SYSTEM_PORT": str(p)}),
                              "--max-model-len", "4096", "--speedup-ratio", "0.05", model_name="tiny", store=store)
                   for p in ports]
        frontend = d16_frontend(d16_env(store), "--router-mode", "kv", "--migration-limit", "1", model="tiny")
        try:
            for i in range(6):
                httpx.post(frontend.url + "/v1/chat/completions", timeout=60, json={
                    "model": "tiny", "messages": [{"role": "user", "content": "hello there world " * (i + 1)}],
                    "max_tokens": 8}).raise_for_status()
                httpx.post(frontend.url + "/v1/completions", timeout=60, json={
                    "model": "tiny", "prompt": "hello there world", "max_tokens": 5, "stream": True}).raise_for_status()
            killed, chunks = None, 0
            with httpx.stream("POST", frontend.url + "/v1/chat/completions", timeout=120, json={
                    "model": "tiny", "messages": [{"role": "user", "content": "tell a long story"}],
                    "max_tokens": 200, "ignore_eos": True, "stream": True}) as reply:
                for line in reply.iter_lines():
                    chunks += line.startswith("data: {")
                    if chunks == 5 and killed is None:
                        killed = next(i for i, p in enumerate(ports) if inflight(p) > 0)
                        mockers[killed].kill()
            assert killed is not None
            OUT.mkdir(parents=True, exist_ok=True)
            (OUT / "dynamo161_frontend.prom").write_text(httpx.get(frontend.url + "/metrics", timeout=5).text)
            (OUT / "dynamo161_worker.prom").write_text(
                httpx.get(f"http://127.0.0.1:{ports[1 - killed]}/metrics", timeout=5).text)
            print(f"recorded into {OUT}")
        finally:
            frontend.stop()
            for m in mockers:
                if m.running:
                    m.stop()


if __name__ == "__main__":
    main()
