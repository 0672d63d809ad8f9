"""A fleet started only with Dynamo 1.x's command lines, ours and 1.6.1's side by side: our ``python -m
dynamo.mocker`` and 1.6.1's ``python -m dynamo.mocker`` on one endpoint, our ``python -m dynamo.frontend`` and
1.6.1's ``python -m dynamo.frontend``, all told only 1.x's flags and variables (file discovery).  Each frontend
serves the model over both workers: a launch script written for 1.x needs no change to mix the two."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import httpx

from harness.dynamo1x import D16Process, d16_env, d16_frontend, d16_mocker
from harness.dynamo1x_kv import SRC
from harness.proc import DynamoRun, DynamoWorker
from harness.wait import wait_until

ENDPOINT = "dyn://clix.backend.generate"


class OurV1Frontend(DynamoRun):
    """Our ``python -m dynamo.frontend`` on a free loopback port."""

    def command(self) -> list[str]:
        return [sys.executable, "-m", "dynamo.frontend", *self.args, "--http-host", "127.0.0.1",
                "--http-port", str(self.port)]


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def served(ours: DynamoWorker, theirs: D16Process) -> tuple[int, int]:
    """(requests our mocker served, requests 1.6.1's mocker served), from their logs."""
    mine = len(re.findall(r"DEBUG dynamo\.worker\.\w+: request ", ours.stderr_text()))
    log = ANSI.sub("", theirs.stderr_text())
    other = len(re.findall(r'request received .*endpoint="generate"', log))
    return mine, other


def chat(url: str) -> dict:
    reply = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "tiny-chat", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_1x_launch_of_both_kinds_serves_from_both_frontends(tiny_chat_5k: Path, store: Path) -> None:
    theirs = d16_env(store)
    ours = dict(theirs, PYTHONPATH=SRC, DYN_LOG="info,dynamo.worker=debug")
    flags = ["--model-path", str(tiny_chat_5k), "--model-name", "tiny-chat", "--endpoint", ENDPOINT,
             "--speedup-ratio", "10"]
    our_mocker = DynamoWorker(*flags, command=[sys.executable, "-m", "dynamo.mocker"], env=ours, startup_timeout=60)
    with our_mocker, d16_mocker(tiny_chat_5k, ENDPOINT, theirs, "--speedup-ratio", "10", "--max-model-len", "2048",
                                model_name="tiny-chat", store=store) as their_mocker:
        wait_until(lambda: len(list((store / "v1" / "instances").glob("clix%2Fbackend%2Fgenerate%2F*"))) == 2, 30,
                   "both mockers' 1.x instance records")
        with OurV1Frontend("--router-mode", "round-robin", env=ours) as frontend:
            wait_until(lambda: len(httpx.get(f"{frontend.base_url}/health").json().get("instances", [])) >= 2, 30,
                       "our frontend to see both mockers")
            for _ in range(4):
                assert chat(frontend.base_url)["usage"]["completion_tokens"] == 4
            after_ours = served(our_mocker, their_mocker)
            assert after_ours[0] >= 1 and after_ours[1] >= 1, after_ours  # round-robin: both kinds answered
        with d16_frontend(theirs, "--router-mode", "round-robin", model="tiny-chat") as frontend:
            for _ in range(4):
                assert chat(frontend.url)["usage"]["completion_tokens"] == 4
            total = served(our_mocker, their_mocker)
            assert total[0] > after_ours[0] and total[1] > after_ours[1], (after_ours, total)
