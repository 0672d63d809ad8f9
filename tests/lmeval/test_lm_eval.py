"""EleutherAI's lm-evaluation-harness against our server with its default settings: ``lm_eval --model
local-completions --model_args model=...,base_url=.../v1/completions`` on three local tasks (tasks/: a
multiple-choice task scored by loglikelihood, a ``generate_until`` task, a ``loglikelihood_rolling``
perplexity task), against ``out=llamacpp`` on SmolLM2 and through ``out=dyn`` (a llamacpp worker, real etcd
and nats-server); ``local-chat-completions`` on the generation task.

What is checked is what a user of the harness relies on: it finds our tokenizer by itself (``GET
/tokenizer_info``, ``/tokenize``: nothing from the Hugging Face hub), and every score it reports is
llama.cpp's own.  Each choice's loglikelihood (and each text's, for perplexity) is recomputed in process
by llama-cpp-python on the same token ids (``harness/llama_reference.py``, the server's context settings)
and must agree within ``TOLERANCE``; each greedy generation must be the reference's argmax continuation.

lm_eval runs from its own virtualenv (``.venv-lmeval``, ``scripts/setup-lmeval-venv.sh``: it pulls
datasets, pandas and scikit-learn, which the server never needs); these tests are skipped without it,
unless ``DYN_LMEVAL_REQUIRED=1`` (``scripts/test-lmeval.sh``, CI) makes that a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from harness.proc import DynamoRun, DynamoWorker, cli_env
from harness.servers import EtcdServer, NatsServer
from harness.smollm2 import SMOLLM2_MODEL
from harness.wait import wait_until

pytestmark = [pytest.mark.lmeval, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
TASKS = Path(__file__).parent / "tasks"
LM_EVAL = REPO / ".venv-lmeval" / "bin" / "lm_eval"
MC, GEN, PPL = "dynamo_tiny_mc", "dynamo_tiny_gen", "dynamo_tiny_ppl"
# |served - in-process| per loglikelihood (a sum over a continuation's tokens).  Measured: at most
# 9.4e-7 over every choice and text of these tasks (float32 logits summed in a different order); a
# setting that differs from the server's (flash attention off) moves them by 0.01 to 0.6.
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def lm_eval() -> Path:
    if not LM_EVAL.exists():
        why = f"{LM_EVAL.relative_to(REPO)} missing: run scripts/setup-lmeval-venv.sh"
        if os.environ.get("DYN_LMEVAL_REQUIRED") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return LM_EVAL


@pytest.fixture(scope="module")
def reference(gguf_in_process: Path) -> Iterator[Any]:
    from harness.llama_reference import LlamaReference

    with LlamaReference(gguf_in_process) as ref:
        yield ref


@pytest.fixture(scope="module")
def tokenizer(gguf: Path) -> Any:
    """The tokenizer the server uses (the one lm_eval reaches through /tokenize)."""
    from dynamo.llm.gguf_card import load_gguf
    from dynamo.llm.tokenizer import Tokenizer

    card = load_gguf(gguf)
    return Tokenizer(card.tokenizer_json), card


@pytest.fixture(scope="module")
def local(gguf: Path) -> Iterator[DynamoRun]:
    with DynamoRun("out=llamacpp", str(gguf), startup_timeout=120) as srv:
        yield srv


@pytest.fixture(scope="module")
def fleet(gguf: Path) -> Iterator[DynamoRun]:
    with EtcdServer() as etcd, NatsServer() as nats_srv:
        env = {"ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats_srv.url}
        worker = DynamoWorker("in=dyn://evals.llamacpp.generate", "out=llamacpp", str(gguf), env=env,
                              startup_timeout=120).start()
        try:
            with DynamoRun("out=dyn", env=env, startup_timeout=60) as frontend:
                wait_until(lambda: SMOLLM2_MODEL in httpx.get(frontend.api_url + "/models").text, 30,
                           "the worker's model on the frontend")
                yield frontend
        finally:
            worker.kill()


class Run:
    """One lm_eval run's output: its log, results and per-task samples."""

    def __init__(self, out_dir: Path, log: str):
        self.log = log
        [results] = out_dir.rglob("results_*.json")
        self.results = json.loads(results.read_text())["results"]
        self.samples: dict[str, list[dict[str, Any]]] = {}
        for path in out_dir.rglob("samples_*.jsonl"):
            task = path.name.removeprefix("samples_").rsplit("_", 1)[0]
            self.samples[task] = [json.loads(line) for line in path.read_text().splitlines()]


def run_lm_eval(lm_eval: Path, server: DynamoRun, tasks: list[str], out_dir: Path, *extra: str,
                model: str = "local-completions", route: str = "/v1/completions", model_args: str = "") -> Run:
    """``lm_eval`` as its README shows it: the model's name and the route's URL, nothing else unless given."""
    args = f"model={SMOLLM2_MODEL},base_url={server.base_url}{route}" + (f",{model_args}" if model_args else "")
    cmd = [str(lm_eval), "--model", model, "--model_args", args, "--tasks", ",".join(tasks), "--include_path", str(TASKS),
           "--output_path", str(out_dir), "--log_samples", *extra]
    # the datasets are local files (read from the tasks folder, the working directory); HF_HOME keeps the
    # datasets cache out of the user's home, the offline switches keep datasets from asking the hub
    env = cli_env({"HF_HOME": str(out_dir / "hf"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    env.pop("PYTHONPATH", None)  # lm_eval's own interpreter: nothing of ours
    done = subprocess.run(cmd, cwd=TASKS, env=env, capture_output=True, text=True, timeout=540)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    return Run(out_dir, log)


def encode_pair(tok: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The token ids lm_eval scores for (context, continuation): trailing spaces move to the continuation,
    the whole text is tokenized and split where the context's tokens end."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    return ctx, whole[len(ctx):]


def check_loglikelihoods(run: Run, reference: Any, tokenizer: Any) -> int:
    """Every choice's and every text's loglikelihood (and greedy flag) equals llama.cpp's in process."""
    tok, card = tokenizer
    checked = 0
    for doc in run.samples[MC]:
        for args, resp in zip(doc["arguments"].values(), doc["resps"], strict=True):
            got, greedy = float(resp[0][0]), resp[0][1] == "True"
            want, want_greedy = reference.loglikelihood(*encode_pair(tok, args["arg_0"], args["arg_1"]))
            assert abs(got - want) <= TOLERANCE, (args, got, want)
            assert greedy == want_greedy, args
            checked += 1
    for doc in run.samples[PPL]:
        text = doc["arguments"]["gen_args_0"]["arg_0"]
        got = float(doc["resps"][0][0])
        # one rolling window: the prefix token (the BOS the server's /tokenizer_info names), then the text
        want, _ = reference.loglikelihood([card.bos_token_id], tok.encode(text))
        assert abs(got - want) <= TOLERANCE, (text, got, want)
        checked += 1
    return checked


def check_generations(run: Run, reference: Any, tokenizer: Any) -> None:
    """Each answer is the reference's greedy continuation of the same ids, cut at the task's stop string."""
    tok, card = tokenizer
    for doc in run.samples[GEN]:
        context, kwargs = doc["arguments"]["gen_args_0"]["arg_0"], doc["arguments"]["gen_args_0"]["arg_1"]
        ids = reference.greedy(tok.encode(context), kwargs["max_gen_toks"], set(card.eos_token_ids))
        want = tok.decode(ids)
        for stop in kwargs["until"]:
            want = want.split(stop)[0]
        assert doc["resps"][0][0] == want, (context, doc["resps"], want)


def test_local_completions_defaults_score_as_llama_cpp(lm_eval, local, reference, tokenizer, tmp_path):
    run = run_lm_eval(lm_eval, local, [MC, GEN, PPL], tmp_path)
    assert "Using remote tokenizer" in run.log  # found /tokenizer_info: nothing downloaded
    assert check_loglikelihoods(run, reference, tokenizer) == 8 * 4 + 3
    check_generations(run, reference, tokenizer)
    assert 0 <= run.results[MC]["acc,none"] <= 1 and run.results[PPL]["word_perplexity,none"] > 1
    assert "exact_match,strip" in run.results[GEN]


def test_through_out_dyn_with_batched_and_concurrent_requests(lm_eval, fleet, reference, tokenizer, tmp_path):
    """The frontend holds the card and tokenizer, a worker scores; then 4 prompts per request and 2
    requests at once (batches of token-id lists, decoded together by the engine) score the same."""
    run = run_lm_eval(lm_eval, fleet, [MC, GEN, PPL], tmp_path / "defaults")
    assert "Using remote tokenizer" in run.log
    check_loglikelihoods(run, reference, tokenizer)
    check_generations(run, reference, tokenizer)
    batched = run_lm_eval(lm_eval, fleet, [MC, PPL], tmp_path / "batched", "--batch_size", "4",
                          model_args="num_concurrent=2")
    check_loglikelihoods(batched, reference, tokenizer)


def test_local_chat_completions_generates(lm_eval, local, tmp_path):
    run = run_lm_eval(lm_eval, local, [GEN], tmp_path, "--apply_chat_template", model="local-chat-completions",
                      route="/v1/chat/completions")
    answers = [doc["resps"][0][0] for doc in run.samples[GEN]]
    assert len(answers) == 4 and all(a.strip() for a in answers)
    assert not any("\n" in a or "Question:" in a for a in answers)  # the task's stop strings were honoured
