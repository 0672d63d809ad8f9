"""``in=batch:FILE.jsonl``: run every prompt of a JSON Lines file, write ``output.jsonl`` beside it.

Every line is checked before anything runs, so a bad line is reported with its number and no work is
lost.  Prompts run with bounded concurrency; results are written in completion order as they finish
(flushed, so an interrupted run keeps what it finished), and a summary with token rates ends the run.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from pathlib import Path
from typing import Any

import orjson
from tqdm import tqdm

from dynamo.errors import EngineError, RequestError, UserError
from dynamo.inputs.chat_request import chat_request
from dynamo.llm.chunks import chunk_finish_reason, chunk_text
from dynamo.llm.engine import Context
from dynamo.llm.pipeline import ServedModel

log = logging.getLogger(__name__)


def read_prompts(path: Path) -> list[str]:
    prompts: list[str] = []
    with path.open("rb") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                entry = orjson.loads(line)
            except orjson.JSONDecodeError as e:
                raise UserError(f"{path}:{n}: not valid JSON ({e})") from None
            if not isinstance(entry, dict) or not isinstance(entry.get("text"), str):
                raise UserError(f'{path}:{n}: each line must be an object with a "text" string, e.g. {{"text": "Hello"}}')
            prompts.append(entry["text"])
    if not prompts:
        raise UserError(f"{path}: no prompts found")
    return prompts


async def run_batch(model: ServedModel, path: Path, *, concurrency: int, ignore_eos: bool) -> int:
    prompts = read_prompts(path)
    out_path = path.with_name("output.jsonl")
    sem = asyncio.Semaphore(concurrency)
    totals = {"in": 0, "out": 0, "failed": 0}
    start = time.monotonic()
    bar = tqdm(total=len(prompts), unit="prompt", file=sys.stderr, dynamic_ncols=True,
               disable=None)  # disable=None: no bar when stderr is not a terminal

    with out_path.open("wb") as out:
        async def one(text: str) -> None:
            async with sem:
                t0 = time.monotonic()
                req, raw = chat_request(model.name, [{"role": "user", "content": text}], ignore_eos=ignore_eos)
                ctx = Context()
                parts: list[str] = []
                finish: str | None = None
                try:
                    stream = model.chat(req, raw, ctx)
                    try:
                        async for chunk in stream:
                            if isinstance(chunk, dict):
                                parts.append(chunk_text(chunk))
                                finish = chunk_finish_reason(chunk) or finish
                    finally:
                        await stream.aclose()  # type: ignore[attr-defined]
                except (RequestError, EngineError) as e:
                    totals["failed"] += 1
                    log.error("prompt failed: %s", e)
                    record: dict[str, Any] = {"text": text, "error": str(e)}
                else:
                    record = {
                        "text": text,
                        "response": "".join(parts),
                        "tokens_in": ctx.prompt_tokens,
                        "tokens_out": ctx.completion_tokens,
                        "elapsed_ms": int((time.monotonic() - t0) * 1000),
                        "finish_reason": finish,
                    }
                    totals["in"] += ctx.prompt_tokens
                    totals["out"] += ctx.completion_tokens
                out.write(orjson.dumps(record) + b"\n")
                out.flush()
                bar.update(1)

        await asyncio.gather(*(one(t) for t in prompts))
    bar.close()
    secs = max(time.monotonic() - start, 1e-9)
    done = len(prompts) - totals["failed"]
    print(
        f"Ran {done} of {len(prompts)} prompts in {secs:.2f}s. "
        f"Tokens in: {totals['in']} ({totals['in'] / secs:.1f}/s). "
        f"Tokens out: {totals['out']} ({totals['out'] / secs:.1f}/s). "
        f"Results: {out_path}",
        file=sys.stderr,
    )
    return 0 if totals["failed"] == 0 else 1
