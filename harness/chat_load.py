"""Steady chat load for tests that watch something react to load (the planner): ``n`` threads each send
streaming chat requests one after another until stopped, counting the ones served and the failures."""

from __future__ import annotations

import threading

import httpx


class ChatLoad:
    """``with ChatLoad(api_url, model, n=4) as load: ...``; ``load.ok`` and ``load.failed`` meanwhile."""

    def __init__(self, api_url: str, model: str, n: int = 4, max_tokens: int = 30,
                 prompt: str = "count to ten please", stagger: float = 0.0) -> None:
        """``stagger``: thread ``i`` starts ``i * stagger`` seconds late, so that the requests of a closed
        loop do not all start and end together (arrivals then come in bursts a request long)."""
        self.api_url, self.model, self.max_tokens, self.prompt = api_url, model, max_tokens, prompt
        self.stop = threading.Event()
        self.ok = 0
        self.failed: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i * stagger,), daemon=True) for i in range(n)]

    def _run(self, delay: float) -> None:
        if self.stop.wait(delay):
            return
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set():
                body = {"model": self.model, "messages": [{"role": "user", "content": self.prompt}],
                        "max_tokens": self.max_tokens, "stream": True}
                try:
                    with client.stream("POST", self.api_url + "/chat/completions", json=body) as r:
                        text = "".join(r.iter_text())
                    if r.status_code == 200 and "[DONE]" in text:
                        self.ok += 1
                    else:
                        self.failed.append(f"{r.status_code} {text[:200]}")
                except httpx.HTTPError as e:
                    self.failed.append(repr(e))

    def __enter__(self) -> "ChatLoad":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)
