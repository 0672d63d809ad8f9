"""Dynamo 1.6.1's own processes, for the interop tier (``scripts/test-dynamo1x.sh``).

The interop tests run the real 1.6.1 wheels (``ai-dynamo`` + ``ai-dynamo-runtime`` from PyPI), installed by
``scripts/setup-dynamo1x-venv.sh`` into a virtualenv of their own (``.venv-dynamo1x``; ``DYN16_PYTHON`` names
another interpreter), next to our processes, all meeting in one store.  Nothing is downloaded at run time:
the model is built here (:func:`build_tiny_chat_5k`).

Why a tokenizer of 5,000+ ids: 1.6.1's mocker emits token ids 1000..4999 whatever the model, so a smaller
vocabulary decodes its answers to nothing.  The ids past the trained BPE vocabulary are filler words
(`` w1000``...) in the byte-level alphabet, so every id the mocker emits decodes to visible text.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Mapping, Self, Sequence

from harness.proc import ChildProcess, free_port
from harness.tiny_model import build_tiny_hf_model

__all__ = [
    "D16_VERSION",
    "D16Process",
    "build_tiny_chat_5k",
    "d16_env",
    "d16_frontend",
    "d16_mocker",
    "d16_python",
    "d16_skip_reason",
]

D16_VERSION = "1.6.1"
TINY_VOCAB = 6000
REPO_ROOT = Path(__file__).resolve().parents[1]


def d16_python() -> Path | None:
    """The interpreter of the 1.6.1 virtualenv, or None when it is not installed."""
    named = os.environ.get("DYN16_PYTHON")
    candidates = [Path(named)] if named else [REPO_ROOT / ".venv-dynamo1x" / "bin" / "python"]
    for path in candidates:
        if path.exists():
            return path
    return None


def d16_skip_reason() -> str | None:
    """Why the interop tests cannot run here (None: they can)."""
    if d16_python() is None:
        return (f"Dynamo {D16_VERSION} is not installed: scripts/test-dynamo1x.sh installs it into .venv-dynamo1x "
                "(or set DYN16_PYTHON)")
    return None


def build_tiny_chat_5k(dest: Path, name: str = "tiny-chat", vocab: int = TINY_VOCAB) -> Path:
    """The tiny ChatML model of :mod:`harness.tiny_model` with its vocabulary padded to ``vocab`` ids.

    Filler ids decode to `` w<id>``; ``config.json``'s ``vocab_size`` follows, so engines that size their
    embeddings from it (ours, llama.cpp through a GGUF) accept every id.
    """
    folder = build_tiny_hf_model(dest, name=name, vocab_size=512)
    tok_path = folder / "tokenizer.json"
    tok = json.loads(tok_path.read_text(encoding="utf-8"))
    table: dict[str, int] = tok["model"]["vocab"]
    taken = set(table.values()) | {t["id"] for t in tok.get("added_tokens", [])}
    next_id = max(taken) + 1
    for token_id in range(next_id, vocab):
        table[f"\u0120w{token_id}"] = token_id  # "\u0120" is the byte-level alphabet's space
    tok_path.write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["vocab_size"] = max(vocab, next_id)
    cfg_path.write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    (folder / "model.safetensors").unlink(missing_ok=True)  # the random weights no longer match the vocabulary
    return folder


def d16_env(store: Path | None = None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a one-machine 1.6.1 fleet on files: discovery in ``store``, TCP requests, ZMQ events,
    everything on loopback (as ``../shared/notes/dynamo-1x.md`` runs it).  With ``store`` None, the caller's
    ``extra`` must say where discovery is (etcd: ``DYN_DISCOVERY_BACKEND=etcd``, ``ETCD_ENDPOINTS``)."""
    env = dict(os.environ)
    for key in ("DYN_LOG", "DYN_METRICS_PREFIX", "DYN_LOGGING_JSONL", "PYTHONPATH", "VIRTUAL_ENV"):
        env.pop(key, None)
    env.update({
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        "DYN_REQUEST_PLANE": "tcp",
        "DYN_EVENT_PLANE": "zmq",
        "DYN_TCP_RPC_HOST": "127.0.0.1",
        "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
        "DYN_EVENT_PLANE_HOST": "127.0.0.1",
    })
    if store is not None:
        env["DYN_DISCOVERY_BACKEND"] = "file"
        env["DYN_FILE_KV"] = str(store)
    if extra:
        env.update(extra)
    return env


class D16Process(ChildProcess):
    """``python -m dynamo.<module> <args>`` of the 1.6.1 virtualenv, ready when ``ready()`` holds."""

    def __init__(self, module: str, args: Sequence[str], env: Mapping[str, str],
                 ready: Callable[[], bool] | None = None, startup_timeout: float = 60.0) -> None:
        super().__init__(None, 0, startup_timeout)
        self.env = dict(env)  # not cli_env: 1.6.1 must not see our PYTHONPATH or our interpreter's packages
        self.module = module
        self.args = list(args)
        self.ready = ready

    def command(self) -> list[str]:
        python = d16_python()
        if python is None:
            raise RuntimeError(d16_skip_reason())
        return [str(python), "-m", f"dynamo.{self.module}", *self.args]

    def _name(self) -> str:
        return f"dynamo {D16_VERSION} {self.module}"

    def start(self) -> Self:
        self._spawn()
        if self.ready is not None:
            self._wait_serving(self.ready, self.startup_timeout)
        return self


def models_listed(url: str) -> set[str]:
    """The model ids ``GET {url}/v1/models`` lists now (empty when it does not answer)."""
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as response:
            body: dict[str, Any] = json.load(response)
    except (urllib.error.URLError, OSError, ValueError):
        return set()
    return {m["id"] for m in body.get("data", [])}


class D16Frontend(D16Process):
    """1.6.1's HTTP frontend on a free loopback port; ``url`` is its base."""

    def __init__(self, env: Mapping[str, str], *flags: str, model: str | None = None,
                 startup_timeout: float = 60.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        ready: Callable[[], bool]
        if model is None:
            ready = self._answers
        else:
            ready = lambda: model in models_listed(self.url)  # noqa: E731
        super().__init__("frontend", ["--http-host", "127.0.0.1", "--http-port", str(self.port), *flags], env,
                         ready, startup_timeout)

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                return True
        except urllib.error.HTTPError:
            return True
        except (urllib.error.URLError, OSError):
            return False


def d16_frontend(env: Mapping[str, str], *flags: str, model: str | None = None) -> D16Frontend:
    """1.6.1's frontend, started: ready once it answers, or once it lists ``model`` when one is named."""
    return D16Frontend(env, *flags, model=model).start()


def d16_mocker(model_dir: Path, endpoint: str, env: Mapping[str, str], *flags: str,
               model_name: str | None = None, store: Path | None = None) -> D16Process:
    """1.6.1's mocker serving ``model_dir`` at ``endpoint`` (``dyn://ns.comp.ep``), started.

    Ready once its card and instance record are in the file ``store`` (when given), else as soon as it runs: a caller
    on etcd waits for the model on a frontend instead."""
    ns, comp, ep = endpoint.removeprefix("dyn://").split(".")
    args = ["--model-path", str(model_dir), "--endpoint", endpoint,
            "--model-name", model_name or model_dir.name, *flags]
    ready: Callable[[], bool] | None = None
    if store is not None:
        prefix = f"{ns}%2F{comp}%2F{ep.replace('_', '%5F')}%2F"

        def ready() -> bool:  # its card and its instance record: 1.6.1 writes them in either order
            folders = (store / "v1" / "mdc", store / "v1" / "instances")
            return all(f.is_dir() and any(p.name.startswith(prefix) for p in f.iterdir()) for f in folders)
    return D16Process("mocker", args, env, ready).start()
