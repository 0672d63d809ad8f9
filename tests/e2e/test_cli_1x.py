"""Dynamo 1.x's command lines as a 1.x launch script writes them, run as real processes: ``python -m
dynamo.frontend`` in front of ``python -m dynamo.mocker --num-workers 2`` (one process, two workers), the
standalone router ``python -m dynamo.router`` answering ``best_worker_id`` and ``generate`` over the runtime,
``python -m dynamo.llama_cpp`` serving SmolLM2 behind the frontend, and every entry point's ``--help`` and
one-line refusal.

Discovery is the file store in a test directory (``DYN_FILE_KV``) with no etcd or NATS named, so the
entry points choose as our one-machine rule does (docs/cli-1x.md, "Discovery"); a test is skipped when an
etcd or NATS answers on the default ports (the rule would take it).
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from harness.fleet import NO_INFRA_ENV, infra_on_default_ports, wait_for_model
from harness.proc import DynamoRun, DynamoWorker, cli_env
from harness.smollm2 import SMOLLM2_MODEL, NotInstalled, smollm2_gguf

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

MODULES = ["frontend", "mocker", "router", "llama_cpp", "vllm", "sglang", "trtllm", "mistralrs"]


def module_cmd(module: str) -> list[str]:
    return [sys.executable, "-m", f"dynamo.{module}"]


class V1Frontend(DynamoRun):
    """``python -m dynamo.frontend ARGS`` on a free loopback port (1.x's flags, not ``in=http``)."""

    def command(self) -> list[str]:
        return module_cmd("frontend") + [*self.args, "--http-host", "127.0.0.1", "--http-port", str(self.port)]


def v1_worker(module: str, *args: str, env: dict[str, str], ready: str = "default") -> DynamoWorker:
    return DynamoWorker(*args, command=module_cmd(module), env=env, ready=ready, startup_timeout=120)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    if infra_on_default_ports():
        pytest.skip("an etcd or NATS answers on this machine's default ports: the one-machine rule would take it")
    return {**NO_INFRA_ENV, "DYN_FILE_KV": str(tmp_path_factory.mktemp("v1kv") / "store"), "DYN_NAMESPACE": ""}


@pytest.fixture(scope="module")
def mocker_fleet(env: dict[str, str], tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[dict[str, Any]]:
    """``python -m dynamo.mocker --num-workers 2`` and ``python -m dynamo.frontend --router-mode kv``."""
    dump = tmp_path_factory.mktemp("dump") / "frontend.json"
    mock = v1_worker("mocker", "--model-path", str(tiny_model), "--endpoint", "dyn://v1.backend.generate",
                     "--num-workers", "2", "--speedup-ratio", "0", "--block-size", "16", env=env,
                     ready=r"(?s)serving .*serving ").start(wait=False)
    fe = None
    try:
        mock.wait_ready(60)
        fe = V1Frontend("--router-mode", "kv", "--dump-config-to", str(dump), env=env).start()
        wait_for_model(fe, "tiny-chat", "dyn://v1.backend.generate", 2, timeout=30)
        yield {"frontend": fe, "mocker": mock, "dump": dump}
    finally:
        if fe is not None:
            fe.stop()
        mock.stop()


def test_frontend_serves_the_mockers_two_workers(mocker_fleet):
    fe = mocker_fleet["frontend"]
    r = httpx.post(fe.api_url + "/chat/completions", timeout=30, json={
        "model": "tiny-chat", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    instances = {i["instance_id"] for i in httpx.get(fe.base_url + "/health").json()["instances"]}
    assert len(instances) == 2  # two workers, one mocker process


def test_dump_config_to_writes_what_the_flags_became(mocker_fleet):
    dumped = json.loads(Path(mocker_fleet["dump"]).read_text())
    assert dumped["module"] == "dynamo.frontend"
    assert dumped["flags"]["router_mode"] == "kv"
    assert dumped["run_config"]["input"] == "http" and dumped["run_config"]["output"] == "dyn"
    assert dumped["run_config"]["router_mode"] == "kv"


def test_standalone_router_answers_best_worker_id_and_generate(mocker_fleet, env, monkeypatch):
    router = v1_worker("router", "--endpoint", "v1.backend.generate",
                       env={**env, "DYN_LOG": "info,dynamo.frontend.router_service=debug"},
                       ready=r"KV router serving v1\.router\.generate").start()
    try:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        asyncio.run(ask_router(router))
    finally:
        router.stop()


async def ask_router(router: DynamoWorker) -> None:
    from dynamo.runtime.distributed import connect_runtime
    from dynamo.runtime.errors import EngineError

    runtime = await connect_runtime()
    try:
        component = runtime.namespace("v1").component("router")
        best = await component.endpoint("best_worker_id").client()
        gen = await component.endpoint("generate").client()
        await best.wait_for_instances(20)
        await gen.wait_for_instances(20)
        tokens = list(range(100, 300))  # 12 full blocks of 16
        workers = set()

        async def best_worker() -> int:
            async for item in best.generate({"token_ids": tokens}):
                return int(item)
            raise AssertionError("best_worker_id answered nothing")

        for _ in range(60):  # until the router has seen both workers (it says "no workers yet" before any)
            try:
                workers.add(await best_worker())
            except EngineError as e:
                assert "no workers" in str(e), e
            if len(workers) == 2:
                break
            await asyncio.sleep(0.25)
        items = [item async for item in gen.generate({
            "token_ids": tokens, "stop_conditions": {"max_tokens": 3}, "sampling_options": {},
            "output_options": {}, "eos_token_ids": []})]
        assert sum(len(i.get("token_ids") or []) for i in items) == 3, items
        assert items[-1].get("finish_reason") == "length", items
        # the worker that served the prompt holds its blocks now, and says so in KV events: the router's
        # answer for the same prompt becomes that worker, whatever it was before
        found = re.search(r"generate \S+: 200 tokens -> worker ([0-9a-f]+)", router.stderr_text())
        assert found, router.stderr_text()[-2000:]
        served = int(found.group(1), 16)
        assert served in workers
        for _ in range(50):
            if await best_worker() == served:
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail(f"best_worker_id never named worker {served:x}, which holds the prompt's blocks")
    finally:
        await runtime.close()


def test_llama_cpp_worker_behind_the_frontend(env):
    try:
        gguf = smollm2_gguf()
    except NotInstalled as e:
        pytest.skip(str(e))
    worker = v1_worker("llama_cpp", "--model-path", str(gguf), "--context-length", "1024", "--namespace", "lc",
                       env=env).start(wait=False)
    fe = None
    try:
        worker.wait_ready(120)
        fe = V1Frontend("--namespace", "lc", env=env).start()
        wait_for_model(fe, SMOLLM2_MODEL, "dyn://lc.backend.generate", 1, timeout=30)
        r = httpx.post(fe.api_url + "/chat/completions", timeout=60, json={
            "model": SMOLLM2_MODEL, "messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 8,
            "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"].strip()
    finally:
        if fe is not None:
            fe.stop()
        worker.stop()


def test_frontend_namespace_prefix_serves_only_the_namespaces_it_starts(env, tiny_model: Path, tmp_path: Path):
    """``--namespace-prefix team-a``: the models of ``team-a1`` (a name it starts), not those of ``other``;
    the prefix wins over ``--namespace``, as in 1.x."""
    env = dict(env, DYN_FILE_KV=str(tmp_path / "store"))
    workers = [v1_worker("mocker", "--model-path", str(tiny_model), "--endpoint", f"dyn://{ns}.backend.generate",
                         "--model-name", name, "--speedup-ratio", "0", env=env).start(wait=False)
               for ns, name in (("team-a1", "in-team"), ("other", "elsewhere"))]
    fe = None
    try:
        for w in workers:
            w.wait_ready(60)
        fe = V1Frontend("--namespace-prefix", "team-a", "--namespace", "other", env=env).start()
        wait_for_model(fe, "in-team", "dyn://team-a1.backend.generate", 1, timeout=30)
        r = httpx.post(fe.api_url + "/chat/completions", timeout=30, json={
            "model": "in-team", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4})
        assert r.status_code == 200, r.text
        listed = {m["id"] for m in httpx.get(fe.api_url + "/models", timeout=5).json()["data"]}
        assert listed == {"in-team"}, listed
    finally:
        if fe is not None:
            fe.stop()
        for w in workers:
            w.stop()


@pytest.mark.parametrize("module", MODULES)
def test_help_lists_what_it_takes_and_refuses(module: str):
    out = subprocess.run(module_cmd(module) + ["--help"], capture_output=True, text=True, env=cli_env(), timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"usage: dynamo.{module}" in out.stdout
    assert "Dynamo 1.x flags taken" in out.stdout and "refused here" in out.stdout


@pytest.mark.parametrize("module, argv, named", [
    ("frontend", ["--router-mode", "least-loaded"], "--router-mode least-loaded"),
    ("frontend", ["--router-ttl-secs", "5"], "--router-ttl-secs"),
    ("mocker", ["--model-path", "M", "--engine-type", "sglang"], "--engine-type sglang"),
    ("router", ["--endpoint", "a.b.c", "--router-block-size", "64"], "--router-block-size"),
    ("llama_cpp", ["--model-path", "m.gguf", "--kv-state-endpoint", "x"], "--kv-state-endpoint"),
    ("vllm", ["--model", "M", "--headless"], "--headless"),
    ("sglang", ["--model-path", "M", "--enable-multimodal"], "--enable-multimodal"),
    ("trtllm", ["--model", "M", "--skip-warmup"], "--skip-warmup"),
    ("mistralrs", ["--model-path", "M", "--connector", "nixl"], "--connector"),
])
def test_a_refused_flag_is_one_line_and_exit_2(module: str, argv: list[str], named: str):
    out = subprocess.run(module_cmd(module) + argv, capture_output=True, text=True, env=cli_env(), timeout=60)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0], out.stderr


def test_a_refused_variable_is_refused_too():
    out = subprocess.run(module_cmd("frontend"), capture_output=True, text=True, timeout=60,
                         env=cli_env({"DYN_ROUTER_TTL_SECS": "5"}))
    assert out.returncode == 2 and "DYN_ROUTER_TTL_SECS" in out.stderr, out.stderr


@pytest.mark.parametrize("argv, says", [
    (["--tcp-tls-cert-path", "/nowhere/server.pem"], "DYN_TCP_TLS_CERT_PATH is set without DYN_TCP_TLS_KEY_PATH"),
    (["--tcp-tls-cert-path", "/nowhere/s.pem", "--tcp-tls-key-path", "/nowhere/k.pem"], "/nowhere/s.pem: no such file"),
], ids=["cert-without-key", "missing-file"])
def test_a_tcp_tls_flag_that_cannot_work_stops_the_frontend_in_one_line(argv: list[str], says: str, tmp_path: Path):
    """1.x's --tcp-tls-* flags are taken (they set DYN_TCP_TLS_*); one that cannot work stops the process at
    start-up, never a frontend serving its planes in plaintext."""
    out = subprocess.run(module_cmd("frontend") + ["--http-port", "0", *argv], capture_output=True, text=True,
                         timeout=60, env=cli_env({"DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(tmp_path)}))
    assert out.returncode != 0 and out.stderr.strip().count("\n") == 0 and says in out.stderr, out.stderr


def test_frontend_interactive_chats_on_stdin(mocker_fleet, env):
    out = subprocess.run(module_cmd("frontend") + ["-i"], input="hello\n", capture_output=True, text=True,
                         timeout=60, env=cli_env(env))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Connected to tiny-chat" in out.stderr, out.stderr[-2000:]
    assert out.stdout.strip(), out.stderr[-2000:]  # the mocker's answer
