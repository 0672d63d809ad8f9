"""Disaggregated serving with mocker workers, under each distributed configuration (etcd and NATS, or
nothing started: harness/dist_configs.py): a prefill worker
(``--disaggregation-mode prefill``), a decode worker and a frontend (``out=dyn --router-mode kv``).

Where each prompt was prefilled is read from the frontend's ``/metrics``
(``dynamo_frontend_disagg_prefill_total{where=remote|local|fallback}``); that the decode worker imported
the (simulated) state, from its debug log.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from harness.dist_configs import DistConfig
from harness.fleet import disagg_prefills, kv_frontend, sees_instances, workers_running, write_engine_args
from harness.proc import DynamoRun, DynamoWorker

pytestmark = pytest.mark.timeout(120)

MOCKER_ARGS = {"num_gpu_blocks": 512, "block_size": 16, "speedup_ratio": 20.0}
MODEL = "dis"


@pytest.fixture(scope="module")
def servers(dist_config: DistConfig) -> dict[str, str]:
    return dist_config.env


@pytest.fixture(scope="module")
def fleet(servers, tiny_model: Path, tmp_path_factory) -> Iterator[dict[str, DynamoWorker]]:
    args_file = write_engine_args(tmp_path_factory.mktemp("mocker") / "mocker.json", MOCKER_ARGS)
    common = ["out=mocker", str(tiny_model), "--model-name", MODEL, "--extra-engine-args", str(args_file)]
    env = {**servers, "DYN_LOG": "info,dynamo.engines.mocker=debug"}
    ws = {"prefill": DynamoWorker(f"in=dyn://{MODEL}.prefill.generate", *common, "--disaggregation-mode", "prefill",
                                  env=env),
          "decode": DynamoWorker(f"in=dyn://{MODEL}.backend.generate", *common, "--disaggregation-mode", "decode",
                                 env=env)}
    with workers_running(ws.values()):
        assert ws["prefill"].ready_match.group("type") == "Prefill"
        assert ws["decode"].ready_match.group("type") == "Backend"
        yield ws


@pytest.fixture(scope="module")
def frontend(servers, fleet) -> Iterator[DynamoRun]:
    with kv_frontend(servers, "--max-local-prefill-length", "32",
                     ready=sees_instances(fleet.values()), what="the frontend to see the workers") as fe:
        yield fe


_rng = random.Random(13)


def text(words: int) -> str:
    return " ".join("".join(_rng.choice("abcdefghij") for _ in range(5)) for _ in range(words))


def complete(fe: DynamoRun, prompt: str, max_tokens: int = 4) -> None:
    r = httpx.post(fe.api_url + "/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens},
                   timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == max_tokens


def test_long_prompts_go_to_the_prefill_worker_short_ones_stay_local(fleet, frontend):
    before = disagg_prefills(frontend, MODEL)
    complete(frontend, text(100))  # hundreds of tokens: remote prefill
    complete(frontend, "hi")  # a few tokens: local
    after = disagg_prefills(frontend, MODEL)
    assert after["remote"] - before["remote"] == 1
    assert after["local"] - before["local"] == 1
    assert "imported the KV state" in fleet["decode"].stderr_text()


def test_prefill_worker_killed_requests_still_answered(fleet, frontend):
    complete(frontend, text(100))
    fleet["prefill"].kill()
    before = disagg_prefills(frontend, MODEL)
    for _ in range(3):
        complete(frontend, text(100))  # no prefill worker (or a dead one not yet noticed): local prefill
    after = disagg_prefills(frontend, MODEL)
    assert after["local"] - before["local"] == 3 and after["remote"] == before["remote"]
