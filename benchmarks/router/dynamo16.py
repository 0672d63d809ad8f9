"""The same workload against NVIDIA Dynamo 1.6's own frontend and mocker (modes ``d16:<router mode>``).

Needs a separate virtualenv holding the original (never the project's .venv: its ``dynamo`` package
would shadow ours)::

    python3 -m venv /tmp/dynamo16-venv
    /tmp/dynamo16-venv/bin/pip install --no-deps ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1
    /tmp/dynamo16-venv/bin/pip install aiohttp msgspec prometheus-client pyzmq uvloop "pydantic<=2.13.5" \\
        typing-extensions tqdm certifi zstandard packaging pyyaml

and ``--dynamo16 /tmp/dynamo16-venv``.  Per run: ``--workers`` processes of ``python -m dynamo.mocker
--model-path <tiny model> --endpoint dyn://<ns>.mocker.generate --num-gpu-blocks-override N --block-size B
--speedup-ratio S ...`` and ``python -m dynamo.frontend --router-mode <mode>`` (``+w=X`` becomes
``--router-kv-overlap-score-credit X``), on the same etcd and NATS.

What is measured differs in two places: the frontend logs ``decode_worker_id=<id>`` for every request,
(one line per request) gives the spread; and the hit rate is ``usage.prompt_tokens_details.cached_tokens`` summed over
the responses / prompt tokens (their workers' metrics travel on their own event plane).  Dynamo 1.6's
mocker does not time steps with the 0.4 formulas our mocker uses (a 334-token prompt has a TTFT of
~25 ms there, ~50 ms of simulated prefill here), so compare the modes' ratios to round-robin, not
the absolute times, across the two stacks.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from harness.proc import DynamoWorker, free_port

ANSI = re.compile(r"\x1b\[[0-9;]*m")
DECODE_WORKER = re.compile(r"\bdecode_worker_id=(\d+)")


def pad_vocab(model_dir: Path, size: int = 5000) -> None:
    """Grow the tiny tokenizer's vocabulary to ``size`` entries.  Dynamo's mocker emits token ids in
    [1000, 5000) whatever the vocabulary; with the tiny model's 512 they decode to nothing, so the stream
    carries no content and the client cannot time tokens.  The extra entries (``Ġrq<id>``, i.e. " rq<id>")
    have no merges, so encoding never produces them: prompts tokenize exactly as before."""
    tok_path = model_dir / "tokenizer.json"
    tok = json.loads(tok_path.read_text())
    vocab = tok["model"]["vocab"]
    used = set(vocab.values()) | {t["id"] for t in tok.get("added_tokens", [])}
    for i in range(size):
        if i not in used:
            vocab[f"\u0120rq{i}"] = i
    tok_path.write_text(json.dumps(tok))
    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["vocab_size"] = max(int(cfg.get("vocab_size") or 0), size)
    cfg_path.write_text(json.dumps(cfg))


def _frontend_flags(mode: str) -> list[str]:
    base, *opts = mode.split("+")
    flags = ["--router-mode", base]
    for o in opts:
        key, _, value = o.partition("=")
        if key == "w":
            flags += ["--router-kv-overlap-score-credit", value]
        elif key == "t":
            flags += ["--router-temperature", value]
        elif key == "approx" or o == "approx":
            flags += ["--no-router-kv-events"]
        else:
            raise SystemExit(f"unknown d16 mode option {o!r}")
    return flags


def run_one_d16(mode: str, ratio: float, convs: list[Any], cfg: Any, args: Any, servers: dict[str, str],
                model_dir: Path, run_index: int, drive: Any, summarize: Any) -> dict[str, Any]:
    venv = Path(args.dynamo16)
    python = str(venv / "bin" / "python")
    ns = f"d16bench{os.getpid()}x{run_index}"
    env = {**servers, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1", "DYN_LOG": "info"}
    workers = [DynamoWorker(
        "--model-path", str(model_dir), "--model-name", "tiny-chat", "--endpoint", f"dyn://{ns}.mocker.generate",
        "--num-gpu-blocks-override", str(args.num_gpu_blocks), "--block-size", str(args.block_size),
        "--speedup-ratio", str(args.speedup_ratio), "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        command=[python, "-m", "dynamo.mocker"], ready=None, env=env) for _ in range(args.workers)]
    port = free_port()
    frontend = DynamoWorker("--http-host", "127.0.0.1", "--http-port", str(port), "--namespace", ns,
                            *_frontend_flags(mode.split(":", 1)[1]),
                            command=[python, "-m", "dynamo.frontend"], ready=None, env=env)
    load_before = os.getloadavg()
    try:
        for w in workers:
            w.start()
        frontend.start()
        _wait_ready(port, frontend, args.workers)
        records, start, end = asyncio.run(drive(port, convs, cfg))
    finally:
        frontend.terminate()
        for w in workers:
            w.terminate()
        for p in [frontend, *workers]:
            try:
                p.stop()
            except Exception as e:
                print(f"  stop: {e}")
    load_after = os.getloadavg()
    log = ANSI.sub("", frontend.stderr_text())
    if args.logs:
        logs = Path(args.logs)
        logs.mkdir(parents=True, exist_ok=True)
        (logs / f"{run_index:02d}-{mode.replace(':', '_')}-{ratio:g}-frontend.log").write_text(log)
    per = Counter(int(m.group(1)) for m in DECODE_WORKER.finditer(log))
    counts = sorted(per.values(), reverse=True) + [0] * max(0, args.workers - len(per))
    total = sum(counts)
    summary = summarize(records, start, end, args.warmup)
    summary.update({
        "mode": mode, "prefix_ratio": ratio, "namespace": ns,
        "hit_rate": summary.get("usage_hit_rate"), "router_hit_rate": None, "router_decisions": None,
        "worker_requests": counts,
        "spread_max_over_mean": round(max(counts) / (total / len(counts)), 2) if total else None,
        "preemptions": None, "per_worker": [{"worker": f"{k:x}", "requests": v} for k, v in per.items()],
        "loadavg_before": [round(x, 2) for x in load_before], "loadavg_after": [round(x, 2) for x in load_after],
    })
    return summary


def _wait_ready(port: int, frontend: DynamoWorker, n: int, timeout: float = 90.0) -> None:
    """The model is listed, and the frontend has logged ``n`` workers' instances (else: after 5 s more)."""
    deadline = time.monotonic() + timeout
    listed_at = None
    while time.monotonic() < deadline:
        if not frontend.running:
            raise RuntimeError(f"Dynamo 1.6 frontend exited:\n{frontend.stderr_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as resp:
                models = json.loads(resp.read()).get("data") or []
        except Exception:
            models = []
        if models:
            listed_at = listed_at or time.monotonic()
            if _instances(port) >= n or time.monotonic() - listed_at > 5:
                return
        time.sleep(0.2)
    raise RuntimeError(f"Dynamo 1.6 frontend not ready after {timeout}s:\n{frontend.stderr_text()[-3000:]}")


def _instances(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            health = json.loads(resp.read())
    except Exception:
        return 0
    inst = health.get("instances") or []
    return len({i.get("instance_id") for i in inst if isinstance(i, dict) and i.get("endpoint") == "generate"})
