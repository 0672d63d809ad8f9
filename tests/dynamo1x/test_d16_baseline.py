"""1.6.1 alone: its frontend in front of its mocker, on the tier's model, proves the tier's footing (the wheels
run here, the model's 6,000 ids decode): every interop test builds on this fleet."""

from __future__ import annotations

from pathlib import Path

import httpx

from harness.dynamo1x import d16_env, d16_frontend, d16_mocker


def test_d16_frontend_serves_its_mocker(tiny_chat_5k: Path, store: Path) -> None:
    env = d16_env(store)
    with d16_mocker(tiny_chat_5k, "dyn://d16.backend.generate", env, "--speedup-ratio", "0", store=store), \
            d16_frontend(env, model="tiny-chat") as frontend:
        reply = httpx.post(f"{frontend.url}/v1/chat/completions", timeout=30, json={
            "model": "tiny-chat", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["usage"]["completion_tokens"] == 4
        # the mocker's ids (1000..4999) are filler words of the padded vocabulary: none decodes to nothing
        assert body["choices"][0]["message"]["content"].count(" w") == 4
