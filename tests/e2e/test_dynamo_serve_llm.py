"""The LLM graphs of ``examples/llm`` under ``dynamo serve``, as the Dynamo README runs them, asked with the
openai SDK: ``agg``, ``agg_router`` and ``disagg`` on llama.cpp with the SmolLM2 GGUF (the default model
when no ``model`` is configured), every mocker config, and ``--Common.model`` pointing a whole graph at
another model.  Real processes on the zero-infrastructure default (file discovery, TCP, ZMQ).
"""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from harness.proc import cli_env, free_port
from harness.serve_graph import SERVE, STARTED, Graph, GraphStarter, alive, env_for
from harness.smollm2 import SMOLLM2_MODEL, NotInstalled, smollm2_gguf
from harness.wait import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_default_infra"), pytest.mark.timeout(300)]

LLM = Path(__file__).resolve().parents[2] / "examples" / "llm"


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[GraphStarter]:
    with GraphStarter(tmp_path, LLM) as starter:
        yield starter


@pytest.fixture(scope="module")
def smollm2_file() -> Path:
    """The SmolLM2 GGUF the graphs use when no model is configured (the mocker reads only its tokenizer)."""
    try:
        return smollm2_gguf(need_llama_cpp=False)
    except NotInstalled as e:
        pytest.skip(str(e))


def client(g: Graph) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{g.http_port}/v1", api_key="unused", timeout=120, max_retries=0)


def wait_served(g: Graph, model: str, *, workers: int = 1, prefill: bool = False) -> None:
    """Until the frontend serves ``model`` from ``workers`` decode/aggregated workers (and a prefill
    worker): the frontend service's table and the frontend's own discovery lines."""
    def ok() -> bool:
        log = g.stderr_text()
        assert g.running, log
        return (f"added model {model} (Backend)" in log
                and len(re.findall(r"\[Worker:\d\] .*worker dyn://dynamo\.backend\.generate serving", log)) >= workers
                and (not prefill or "prefill workers at dyn://dynamo.prefill.generate" in log))
    wait_until(ok, 180, f"the frontend serving {model}")


def ask(g: Graph, model: str, text: str, max_tokens: int = 6) -> openai.types.chat.ChatCompletion:
    return client(g).chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                             max_tokens=max_tokens, temperature=0)


def remote_prefills(g: Graph, model: str) -> float:
    metrics = httpx.get(f"http://127.0.0.1:{g.http_port}/metrics").text
    m = re.search(rf'dynamo_frontend_disagg_prefill_total\{{model="{re.escape(model)}",where="remote"\}} (\S+)', metrics)
    return float(m.group(1)) if m else 0.0


def long_prompt(topic: str) -> str:
    return f"Tell me about {topic}. " + " ".join(f"{topic} number {i} is worth a sentence." for i in range(30))


def test_agg_answers_a_chat_completion_and_prints_the_served_model_table(serve, gguf):
    """The Dynamo README's quick start, as written: ``cd examples/llm && dynamo serve graphs.agg:Frontend -f
    configs/agg.yaml`` (no model configured: the SmolLM2 GGUF the set-up installs)."""
    g = serve("graphs.agg:Frontend", "-f", "configs/agg.yaml", want={"Frontend": 1, "Worker": 1})
    wait_served(g, SMOLLM2_MODEL)
    r = ask(g, SMOLLM2_MODEL, "What is 2+2?", max_tokens=12)
    assert "4" in (r.choices[0].message.content or "")
    log = g.stderr_text()
    assert f"[Frontend:0] Added new chat model {SMOLLM2_MODEL}" in log
    assert re.search(r"\[Frontend:0\] \| MODEL TYPE \| MODEL NAME +\| NAMESPACE \| COMPONENT \| ENDPOINT \|", log)
    assert re.search(rf"\[Frontend:0\] \| chat +\| {re.escape(SMOLLM2_MODEL)} \| dynamo +\| backend +\| generate \|", log)
    assert "[Worker:0] " in log


def test_agg_router_sends_a_repeated_prompt_to_the_worker_that_cached_it(serve, gguf):
    """Two llama.cpp workers behind ``router-mode: kv``: every repeated long prompt finds most of itself in
    the cache of the worker it went to (round-robin would send each repeat to the other worker, which
    holds only the chat template's shared start)."""
    g = serve("graphs.agg_router:Frontend", "-f", "configs/agg_router.yaml", want={"Frontend": 1, "Worker": 2})
    wait_served(g, SMOLLM2_MODEL, workers=2)
    for topic in ("apples", "rivers", "engines"):
        first = ask(g, SMOLLM2_MODEL, long_prompt(topic), max_tokens=2)
        again = ask(g, SMOLLM2_MODEL, long_prompt(topic), max_tokens=2)
        assert first.usage is not None and again.usage is not None
        cached = (again.usage.prompt_tokens_details.cached_tokens or 0) if again.usage.prompt_tokens_details else 0
        assert cached >= again.usage.prompt_tokens // 2, (topic, again.usage)


def test_disagg_prefills_a_long_prompt_on_the_prefill_worker(serve, gguf):
    g = serve("graphs.disagg:Frontend", "-f", "configs/disagg.yaml",
              want={"Frontend": 1, "Worker": 1, "PrefillWorker": 1})
    wait_served(g, SMOLLM2_MODEL, prefill=True)
    r = ask(g, SMOLLM2_MODEL, long_prompt("colors"), max_tokens=6)
    assert r.choices[0].message.content
    assert remote_prefills(g, SMOLLM2_MODEL) == 1.0  # over max-local-prefill-length: the prefill worker did it
    short = ask(g, SMOLLM2_MODEL, "What is 2+2?", max_tokens=12)
    assert "4" in (short.choices[0].message.content or "")
    assert remote_prefills(g, SMOLLM2_MODEL) == 1.0  # a short prompt is prefilled where it decodes
    assert re.search(rf"\[Frontend:0\] \| prefill +\| {re.escape(SMOLLM2_MODEL)} \| dynamo +\| prefill +\| generate \|",
                     g.stderr_text())


@pytest.mark.parametrize("graph,config,workers,disagg", [
    ("graphs.agg", "agg_mocker", 2, False),
    ("graphs.agg_router", "agg_router_mocker", 2, False),
    ("graphs.disagg", "disagg_mocker", 1, True),
    ("graphs.disagg", "disagg_router_mocker", 1, True),
])
def test_every_mocker_config_answers(serve, smollm2_file, graph, config, workers, disagg):
    want = {"Frontend": 1, "Worker": workers, **({"PrefillWorker": 1} if disagg else {})}
    g = serve(f"{graph}:Frontend", "-f", f"configs/{config}.yaml", want=want)
    wait_served(g, SMOLLM2_MODEL, workers=workers, prefill=disagg)
    r = ask(g, SMOLLM2_MODEL, long_prompt("clouds"))
    assert r.usage is not None and r.usage.completion_tokens == 6
    assert remote_prefills(g, SMOLLM2_MODEL) == (1.0 if disagg else 0.0)


def test_agg_processor_serves_through_the_processor_only(serve, smollm2_file):
    """Frontend -> Processor -> Worker: the frontend (``namespace: dynamo``) serves the Processor's chat
    model and never the workers' (``workers`` namespace); the Processor templates, tokenizes, routes."""
    g = serve("graphs.agg_processor:Frontend", "-f", "configs/agg_processor_mocker.yaml",
              want={"Frontend": 1, "Processor": 1, "Worker": 1})
    wait_until(lambda: f"added model {SMOLLM2_MODEL} (Chat) served by dyn://dynamo.Processor.chat" in g.stderr_text(),
               180, "the frontend serving the Processor's model")
    r = ask(g, SMOLLM2_MODEL, "What is 2+2?")
    assert r.choices[0].message.content and r.choices[0].finish_reason == "length"
    # a whole answer reports the Processor's counts (the prompt it templated), not chunks counted at the frontend
    assert r.usage is not None and r.usage.prompt_tokens > 5, r.usage
    chunks = list(client(g).chat.completions.create(
        model=SMOLLM2_MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=3, stream=True,
        stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens > 0 and usage.completion_tokens == 3  # the Processor tokenized
    log = g.stderr_text()
    assert not re.search(r"\[Frontend:0\] .*added model .*\(Backend\)", log)  # the workers are not its own
    assert re.search(rf"\[Frontend:0\] \| chat +\| {re.escape(SMOLLM2_MODEL)} \| dynamo +\| Processor \| chat +\|", log)
    assert not re.search(r"\[Frontend:0\] \| chat .*\| workers ", log)  # its table shows what it serves


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (Linux /proc: each thread's children)."""
    out: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            todo += [k for k in kids if k not in out]
            out.update(kids)
    return out


def test_sigterm_stops_the_whole_llm_graph_roles_included(serve, smollm2_file):
    g = serve("graphs.disagg:Frontend", "-f", "configs/disagg_mocker.yaml",
              want={"Frontend": 1, "Worker": 1, "PrefillWorker": 1})
    wait_served(g, SMOLLM2_MODEL, prefill=True)
    procs = descendants(g.pid)
    assert len(procs) >= 6  # three services, each with its dynamo-run role
    g.terminate(signal.SIGTERM)
    assert g.wait(90) == 0, g.stderr_text()
    assert not [pid for pid in procs if alive(pid)]


def test_common_model_points_every_service_at_another_model(serve, tiny_model):
    g = serve("graphs.disagg:Frontend", "-f", "configs/disagg_mocker.yaml", f"--Common.model={tiny_model}",
              want={"Frontend": 1, "Worker": 1, "PrefillWorker": 1})
    wait_served(g, "tiny-chat", prefill=True)
    r = ask(g, "tiny-chat", long_prompt("stones"))
    assert r.model == "tiny-chat" and r.choices[0].message.content is not None
    assert remote_prefills(g, "tiny-chat") == 1.0  # the prefill worker serves the same model
    assert SMOLLM2_MODEL not in g.stderr_text()


def test_a_role_that_reports_an_error_stops_the_graph_without_restarts(tmp_path):
    """A dynamo-run role exiting with status 1 (a missing model) fails the same way every time: one error
    line, exit 1, nothing restarted or left running."""
    p = subprocess.run(SERVE + ["graphs.agg:Frontend", "-f", "configs/agg.yaml", f"--Frontend.port={free_port()}",
                                "--Common.model=/nonexistent/model.gguf"],
                       cwd=LLM, capture_output=True, text=True, env=cli_env(env_for(tmp_path)), timeout=120)
    assert p.returncode == 1, p.stderr
    assert "[Worker:0] Error: /nonexistent/model.gguf" in p.stderr
    assert p.stderr.rstrip().splitlines()[-1] == \
        "error: service Worker failed: dynamo-run exited with status 1 (its error is above)"
    assert "restarting" not in p.stderr
    pids = [int(m.group(3)) for m in STARTED.finditer(p.stderr)]
    assert pids and not [pid for pid in pids if alive(pid)]
