"""LoRA adapters on ``out=vllm`` for real: vLLM's CPU build serving the tiny Llama with PEFT adapters written
by harness/lora_peft.py, given at start (``--lora name=folder``) and loaded and unloaded at run time
(``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter`` behind ``DYN_ALLOW_RUNTIME_LORA_UPDATING``).

A non-zero adapter changes greedy output and a zero one (``B = 0``) does not; adapters and the base model
run concurrently (vLLM batches them) and each answer equals that model's answer alone; bad adapters (no
folder, a rank over ``max_lora_rank``, tensors of another model's shapes) are 400s in the OpenAI shape and
the server keeps serving; a bad adapter at start is one line and exit 1, before vLLM starts.

One server for the module (vLLM takes 20-60 s to start here).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from harness.lora_peft import write_peft_lora
from harness.proc import DynamoRun, run_cli
from harness.tiny_model import build_tiny_hf_model
from harness.vllm_tier import STARTUP_TIMEOUT, serving, vllm_cache_env, vllm_tier

pytestmark = vllm_tier()

PROMPT = "Once upon a time, in a small village by the sea,"


@pytest.fixture(scope="module")
def vllm_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    cache = tmp_path_factory.mktemp("vllm-lora-cache")
    return {**vllm_cache_env(cache), "DYN_ALLOW_RUNTIME_LORA_UPDATING": "true"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_hf_model(tmp_path_factory.mktemp("vllm-lora-models"))


@pytest.fixture(scope="module")
def adapters(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vllm-lora-adapters")
    return {"strong": write_peft_lora(root / "strong", model, seed=1),
            "zero": write_peft_lora(root / "zero", model, seed=2, scale=0.0),
            "other": write_peft_lora(root / "other", model, seed=3),
            "rank32": write_peft_lora(root / "rank32", model, seed=4, rank=32),
            "wide": write_peft_lora(root / "wide", model, seed=5, n_in=96),
            "noweights": write_peft_lora(root / "noweights", model, seed=6, with_weights=False)}


@pytest.fixture(scope="module")
def server(model: Path, adapters: dict[str, Path], vllm_env: dict[str, str]) -> Iterator[DynamoRun]:
    with serving(DynamoRun("out=vllm", str(model), "--context-length", "512",
                           "--lora", f"strong={adapters['strong']}", "--lora", f"zero={adapters['zero']}",
                           env=vllm_env, startup_timeout=STARTUP_TIMEOUT), "vLLM server with LoRA") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: DynamoRun) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server: DynamoRun) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


def greedy(client: openai.OpenAI, model: str, max_tokens: int = 12) -> str:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == max_tokens
    return r.choices[0].text


def test_start_adapters_are_listed_with_their_parent(client: openai.OpenAI, adapters: dict[str, Path]) -> None:
    listed = {m.id: m for m in client.models.list().data}
    assert set(listed) == {"tiny-chat", "strong", "zero"}
    assert listed["strong"].model_extra == {"root": str(adapters["strong"]), "parent": "tiny-chat", "input_modalities": ["text"]}


def test_an_adapter_changes_greedy_output_and_a_zero_one_does_not(client: openai.OpenAI) -> None:
    base = greedy(client, "tiny-chat")
    assert greedy(client, "strong") != base
    assert greedy(client, "zero") == base
    assert greedy(client, "tiny-chat") == base  # the adapters left the base model as it was


def test_run_time_load_and_unload(client: openai.OpenAI, http: httpx.Client, adapters: dict[str, Path]) -> None:
    base, strong = greedy(client, "tiny-chat"), greedy(client, "strong")
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "other", "lora_path": str(adapters["other"])})
    assert r.status_code == 200 and "added successfully" in r.text, r.text
    listed = {m.id: m for m in client.models.list().data}
    assert listed["other"].model_extra == {"root": str(adapters["other"]), "parent": "tiny-chat", "input_modalities": ["text"]}
    other = greedy(client, "other")
    assert other not in (base, strong)
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "other"})
    assert r.status_code == 200 and "removed successfully" in r.text
    assert "other" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        greedy(client, "other")
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "other"})
    assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]
    # loaded again (a new adapter to vLLM): the same weights give the same answer
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "other", "lora_path": str(adapters["other"])})
    assert r.status_code == 200, r.text
    assert greedy(client, "other") == other
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "other"}).status_code == 200


def test_base_and_adapters_concurrently_each_equal_to_its_own(client: openai.OpenAI, http: httpx.Client,
                                                              adapters: dict[str, Path]) -> None:
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "other2", "lora_path": str(adapters["other"])})
    assert r.status_code == 200, r.text
    try:
        models = ["tiny-chat", "strong", "other2", "zero"]
        alone = {m: greedy(client, m, 24) for m in models}
        assert len({alone["tiny-chat"], alone["strong"], alone["other2"]}) == 3
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda m: (m, greedy(client, m, 24)), models * 2))
        for m, text in together:
            assert text == alone[m], m
    finally:
        http.post("/v1/unload_lora_adapter", json={"lora_name": "other2"})


def test_unloading_while_a_request_runs_lets_it_finish_with_the_adapter(client: openai.OpenAI, http: httpx.Client,
                                                                        adapters: dict[str, Path]) -> None:
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "running", "lora_path": str(adapters["other"])})
    assert r.status_code == 200, r.text
    alone = greedy(client, "running", 400)
    arrived: list[tuple[float, str, str | None]] = []  # (when, text, finish_reason), read as they come
    first = threading.Event()

    def consume() -> None:
        for c in client.completions.create(model="running", prompt=PROMPT, max_tokens=400, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}):
            if c.choices:
                arrived.append((time.monotonic(), c.choices[0].text, c.choices[0].finish_reason))
                first.set()

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    assert first.wait(60)
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "running"})
    unloaded = time.monotonic()
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):  # new requests: the name is gone
        greedy(client, "running")
    reader.join(120)
    after = [t for t, _, _ in arrived if t > unloaded]
    print(f"\n{len(after)} of {len(arrived)} chunks generated after the unload")
    assert after, "the request finished before the unload: nothing was tested"
    assert "".join(text for _, text, _ in arrived) == alone  # it finished with the adapter's weights
    assert [f for _, _, f in arrived if f] == ["length"]


@pytest.mark.parametrize("which, says", [
    ("missing", "no such folder"),
    ("noweights", "no adapter_model.safetensors"),
    ("rank32", "rank 32 is over this server's max_lora_rank 16"),
    ("wide", "vLLM cannot load it"),  # tensors of another model's shapes: only vLLM can tell
])
def test_a_bad_adapter_is_a_400_and_the_server_keeps_serving(client: openai.OpenAI, http: httpx.Client,
                                                             adapters: dict[str, Path], which: str,
                                                             says: str) -> None:
    base, strong = greedy(client, "tiny-chat"), greedy(client, "strong")
    path = adapters[which] if which in adapters else adapters["strong"].parent / "nowhere"
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(path)})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert says in error["message"] and "\n" not in error["message"], error
    assert "bad" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        greedy(client, "bad")
    assert greedy(client, "tiny-chat") == base and greedy(client, "strong") == strong


def test_a_name_taken_is_a_400(http: httpx.Client, adapters: dict[str, Path]) -> None:
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "strong", "lora_path": str(adapters["other"])})
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]


def test_a_bad_adapter_at_start_is_one_line_and_exit_1(model: Path, adapters: dict[str, Path],
                                                       vllm_env: dict[str, str]) -> None:
    r = run_cli(["in=http", "out=vllm", str(model), "--http-port", "0",
                 "--lora", f"big={adapters['noweights']}"], env=vllm_env, timeout=300)
    assert r.returncode == 1, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "adapter_model.safetensors" in errors[0], r.stderr[-3000:]
    assert "Traceback" not in r.stderr
