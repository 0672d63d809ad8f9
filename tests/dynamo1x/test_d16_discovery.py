"""Discovery across the two implementations, with real processes, on the file store and on etcd: Dynamo
1.6.1's frontend lists the model of a worker of ours (our ``v1/instances`` and ``v1/mdc`` records, its
card's files, our card in the extra field it ignores) and rejects, naming them, the models it must not
serve; our frontend lists the model of 1.6.1's mocker (its records, read as ours); each model goes when its
worker stops. Requests across are the request plane's tests."""

from __future__ import annotations

from pathlib import Path

from harness.dynamo1x import d16_env, d16_frontend, d16_mocker, models_listed
from harness.dynamo1x_kv import SRC
from harness.proc import DynamoRun, DynamoWorker
from harness.wait import wait_until


def test_d16_frontend_lists_our_workers_model(tiny_chat_5k: Path, envs) -> None:
    theirs, ours, _ = envs
    worker = DynamoWorker("in=dyn://ours.backend.generate", "out=mocker", str(tiny_chat_5k), "--model-name", "ours-model",
                          env=ours, startup_timeout=60).start()
    try:
        with d16_frontend(theirs, model="ours-model") as frontend:  # ready once /v1/models lists it
            worker.stop()
            wait_until(lambda: "ours-model" not in models_listed(frontend.url), 30,
                       "1.6.1's frontend drops the model of our stopped worker")
    finally:
        worker.stop()


def test_our_frontend_lists_d16_mockers_model(tiny_chat_5k: Path, envs) -> None:
    theirs, ours, store = envs
    with DynamoRun("out=dyn", env=ours, startup_timeout=60) as frontend:
        mocker = d16_mocker(tiny_chat_5k, "dyn://m16.backend.generate", theirs, "--speedup-ratio", "0",
                            model_name="m16-model", store=store)
        try:
            wait_until(lambda: "m16-model" in models_listed(frontend.base_url), 30,
                       "our frontend lists 1.6.1's mocker's model")
            mocker.stop()
            wait_until(lambda: "m16-model" not in models_listed(frontend.base_url), 30,
                       "our frontend drops the model of the stopped mocker")
        finally:
            mocker.stop()


def test_one_model_over_both_kinds_of_worker_on_one_endpoint(tiny_chat_5k: Path, envs) -> None:
    """Our worker and 1.6.1's mocker serve one model on one endpoint: our frontend serves it once, over both
    instances (one record each, in one bucket)."""
    import httpx

    theirs, ours, store = envs
    worker = DynamoWorker("in=dyn://mix.backend.generate", "out=mocker", str(tiny_chat_5k), "--model-name", "shared",
                          env=ours, startup_timeout=60).start()
    try:
        with d16_mocker(tiny_chat_5k, "dyn://mix.backend.generate", theirs, "--speedup-ratio", "0",
                        model_name="shared", store=store), DynamoRun("out=dyn", env=ours, startup_timeout=60) as frontend:
            def instances() -> list[int]:
                body = httpx.get(f"{frontend.base_url}/health", timeout=5).json()
                return sorted(i["instance_id"] for i in body.get("instances", [])
                              if i["endpoint"] == "dyn://mix.backend.generate" and "shared" in i["models"])

            wait_until(lambda: len(instances()) == 2, 30,
                       "our frontend serves 'shared' over both workers")
            assert worker.instance_id in instances()
            assert models_listed(frontend.base_url) == {"shared"}
    finally:
        worker.stop()


def test_d16_frontend_lists_our_gguf_workers_model(tiny_chat_5k: Path, store: Path, tmp_path: Path) -> None:
    """A GGUF model has no tokenizer.json: the worker writes the files 1.6.1 loads (tokenizer, template,
    config) from the GGUF into its cache and names them in the card."""
    from harness.tiny_model import build_tiny_gguf

    gguf = build_tiny_gguf(tmp_path / "tiny.gguf", tiny_chat_5k)
    theirs = d16_env(store)
    ours = dict(theirs, PYTHONPATH=SRC, XDG_CACHE_HOME=str(tmp_path / "cache"))
    with DynamoWorker("in=dyn://gg.backend.generate", "out=mocker", str(gguf), "--model-name", "gguf-model",
                      env=ours, startup_timeout=60), d16_frontend(theirs, model="gguf-model"):
        cached = list((tmp_path / "cache" / "dynamo" / "v1_cards").glob("*/tokenizer.json"))
        assert len(cached) == 1


def test_d16_frontend_rejects_our_models_it_cannot_serve_and_serves_the_rest(tiny_chat_5k: Path, envs) -> None:
    """A prefill worker of ours and a worker whose card has no tokenizer announce their models with a
    ``model_type`` 1.6.1 does not know: it rejects each in one line naming the flag, lists neither, and
    serves the model of our ordinary worker beside them."""
    import httpx

    theirs, ours, _ = envs
    workers = [DynamoWorker(*args, env=ours, startup_timeout=60) for args in (
        ("in=dyn://hid.prefill.generate", "out=mocker", str(tiny_chat_5k), "--model-name", "hidden-prefill",
         "--disaggregation-mode", "prefill"),
        ("in=dyn://hid.noname.generate", "out=echo_full", "--model-name", "hidden-nofiles"),
        ("in=dyn://hid.backend.generate", "out=mocker", str(tiny_chat_5k), "--model-name", "shown"),
    )]
    try:
        for worker in workers:
            worker.start()
        with d16_frontend(theirs, model="shown") as frontend:
            for flag in ("PrefillOverOurTransfer", "NoTokenizerFiles"):
                wait_until(lambda: f"unrecognized named flag `{flag}`" in frontend.stderr_text(), 30,  # noqa: B023
                           f"1.6.1's frontend rejects the {flag} record")
            assert models_listed(frontend.url) == {"shown"}
            resp = httpx.post(f"{frontend.url}/v1/chat/completions", timeout=30, json={
                "model": "shown", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["finish_reason"] == "length"
    finally:
        for worker in workers:
            worker.stop()
