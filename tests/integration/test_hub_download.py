"""Model download from a Hugging Face hub, for real, against a local hub the test runs.

The hub cannot be reached from the test machines, so :class:`FakeHub` speaks the part of the Hub API
that ``huggingface_hub.snapshot_download`` uses (as read from its source):

* ``GET /api/models/{repo}/revision/{rev}``: model info with ``sha`` (the commit) and ``siblings``;
* ``GET /api/models/{repo}/tree/{rev}?recursive=...``: the file listing (``type``, ``path``, ``size``,
  ``oid`` = git blob id, ``lfs`` for large files);
* ``HEAD``/``GET /{repo}/resolve/{rev}/{filename}``: the file, with ``X-Repo-Commit``, ``ETag`` (the git
  blob sha1, or the sha256 for LFS files, as the hub sends it) and ``Content-Length``;
* a missing repo is a 404 with ``X-Error-Code: RepoNotFound`` like the hub (or a bare 404, as a mirror
  may send).

``dynamo-run`` then fetches a tiny model built by ``harness/tiny_model.py`` with
``HF_ENDPOINT`` pointing at it and ``HF_HOME`` in a temporary folder.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import pty
import struct
import subprocess
import termios
import threading
from pathlib import Path

import pytest
from aiohttp import web

from harness.proc import DynamoRun, cli_command, cli_env, free_port, run_cli
from harness.tiny_model import build_tiny_hf_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"
LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")


class FakeHub:
    """A Hugging Face hub serving local folders as repos, on a loopback port, in a thread."""

    def __init__(self, repos: dict[str, Path], *, bare_404: bool = False):
        self.repos = repos
        self.bare_404 = bare_404
        self.requests: list[str] = []
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "FakeHub":
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    # -- the server ---------------------------------------------------------------------------
    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/api/models/{org}/{name}/revision/{rev}", self._info)
        app.router.add_get("/api/models/{org}/{name}", self._info)
        app.router.add_get("/api/models/{org}/{name}/tree/{rev}", self._tree)
        app.router.add_get("/{org}/{name}/resolve/{rev}/{filename:.+}", self._file)  # and HEAD
        runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())

    def _repo(self, request: web.Request) -> tuple[str, Path]:
        self.requests.append(f"{request.method} {request.path}")
        repo = f"{request.match_info['org']}/{request.match_info['name']}"
        folder = self.repos.get(repo)
        if folder is None:
            headers = {} if self.bare_404 else {"X-Error-Code": "RepoNotFound",
                                                "X-Error-Message": "Repository not found"}
            raise web.HTTPNotFound(headers=headers, text=json.dumps({"error": "Repository not found"}),
                                   content_type="application/json")
        rev = request.match_info.get("rev", "main")
        if rev not in ("main", COMMIT):
            raise web.HTTPNotFound(headers={"X-Error-Code": "RevisionNotFound"}, text="Revision not found")
        return repo, folder

    def _files(self, folder: Path) -> list[Path]:
        return sorted(p for p in folder.rglob("*") if p.is_file())

    async def _info(self, request: web.Request) -> web.Response:
        repo, folder = self._repo(request)
        siblings = [{"rfilename": str(p.relative_to(folder))} for p in self._files(folder)]
        return web.json_response({"_id": "x", "id": repo, "modelId": repo, "author": repo.split("/")[0],
                                  "sha": COMMIT, "private": False, "gated": False, "disabled": False,
                                  "tags": [], "siblings": siblings})

    async def _tree(self, request: web.Request) -> web.Response:
        repo, folder = self._repo(request)
        entries = []
        for p in self._files(folder):
            data = p.read_bytes()
            entry = {"type": "file", "path": str(p.relative_to(folder)), "size": len(data), "oid": _git_oid(data)}
            if p.suffix in LFS_SUFFIXES:
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            entries.append(entry)
        return web.json_response(entries)

    async def _file(self, request: web.Request) -> web.StreamResponse:
        repo, folder = self._repo(request)
        path = (folder / request.match_info["filename"]).resolve()
        if not path.is_file() or folder.resolve() not in path.parents:
            raise web.HTTPNotFound(headers={"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT},
                                   text="Entry not found")
        data = path.read_bytes()
        etag = hashlib.sha256(data).hexdigest() if path.suffix in LFS_SUFFIXES else _git_oid(data)
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{etag}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        # for a HEAD, aiohttp sends these headers and the Content-Length of the body, without the body
        return web.Response(body=data, headers=headers)


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@pytest.fixture(scope="module")
def tiny_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = build_tiny_hf_model(tmp_path_factory.mktemp("hub"), name="tiny-model")
    (folder / "README.md").write_text("# tiny model\n")  # skipped by the download
    (folder / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    return folder


def _hf_env(hub_url: str, home: Path, **extra: str) -> dict[str, str]:
    env = {"HF_ENDPOINT": hub_url, "HF_HOME": str(home), "HF_HUB_OFFLINE": "0",
           "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_ETAG_TIMEOUT": "5", "HF_HUB_DOWNLOAD_TIMEOUT": "10"}
    env.update(extra)
    return env


def _one_error_line(p: subprocess.CompletedProcess[str]) -> str:
    assert p.returncode != 0, p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1, p.stderr
    return errors[0]


def test_download_then_offline_from_cache(tiny_repo: Path, tmp_path: Path) -> None:
    home = tmp_path / "hf"
    with FakeHub({"org/tiny-model": tiny_repo}) as hub:
        p = run_cli(["in=stdin", "out=echo_core", "org/tiny-model"], input="hello there",
                    env=_hf_env(hub.url, home), timeout=60)
        assert p.returncode == 0, p.stderr
        assert "hello there" in p.stdout
        assert any(r.startswith("GET /api/models/org/tiny-model/revision/main") for r in hub.requests)
        assert any(r.startswith("GET /org/tiny-model/resolve/") and r.endswith("model.safetensors")
                   for r in hub.requests)
        assert not any(r.endswith(("README.md", ".gitattributes")) for r in hub.requests)
        snapshot = home / "hub" / "models--org--tiny-model" / "snapshots" / COMMIT
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
            assert (snapshot / name).read_bytes() == (tiny_repo / name).read_bytes(), name
        assert not (snapshot / "README.md").exists()
        assert (home / "hub" / "models--org--tiny-model" / "refs" / "main").read_text() == COMMIT

        # offline: the cache alone serves it, nothing is asked of the hub
        before = len(hub.requests)
        p = run_cli(["in=stdin", "out=echo_core", "org/tiny-model"], input="again",
                    env=_hf_env(hub.url, home, HF_HUB_OFFLINE="1"), timeout=60)
        assert p.returncode == 0, p.stderr
        assert "again" in p.stdout
        assert len(hub.requests) == before

        # online again: a cache hit, only metadata is asked for
        before = len(hub.requests)
        p = run_cli(["in=stdin", "out=echo_core", "hf://org/tiny-model"], input="third",
                    env=_hf_env(hub.url, home), timeout=60)
        assert p.returncode == 0, p.stderr
        assert "third" in p.stdout
        assert hub.requests[before:] and all(r.startswith("GET /api/models/") for r in hub.requests[before:])


def test_served_name_is_the_repo_id(tiny_repo: Path, tmp_path: Path) -> None:
    import httpx

    with FakeHub({"org/tiny-model": tiny_repo}) as hub:
        with DynamoRun("out=echo_core", "hf://org/tiny-model", env=_hf_env(hub.url, tmp_path / "hf"),
                       startup_timeout=60) as proc:
            models = httpx.get(proc.api_url + "/models", timeout=10).json()
            assert [m["id"] for m in models["data"]] == ["org/tiny-model"]
            r = httpx.post(proc.api_url + "/chat/completions", timeout=30, json={
                "model": "org/tiny-model", "ignore_eos": True, "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200 and "hi" in r.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("bare", [False, True], ids=["hub-404", "bare-404"])
def test_missing_repo_is_one_clear_line(tiny_repo: Path, tmp_path: Path, bare: bool) -> None:
    with FakeHub({"org/tiny-model": tiny_repo}, bare_404=bare) as hub:
        p = run_cli(["in=stdin", "out=echo_core", "org/no-such-model"], input="hi",
                    env=_hf_env(hub.url, tmp_path / "hf"), timeout=60)
    line = _one_error_line(p)
    assert "org/no-such-model" in line and "does not exist" in line


def test_unreachable_hub_is_one_clear_line(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    p = run_cli(["in=stdin", "out=echo_core", "org/tiny-model"], input="hi",
                env=_hf_env(dead, tmp_path / "hf"), timeout=60)
    line = _one_error_line(p)
    assert "cannot be reached" in line and dead in line and "org/tiny-model" in line


def test_offline_and_not_cached_is_one_clear_line(tmp_path: Path) -> None:
    p = run_cli(["in=stdin", "out=echo_core", "org/tiny-model"], input="hi",
                env=_hf_env("http://127.0.0.1:9", tmp_path / "hf", HF_HUB_OFFLINE="1"), timeout=60)
    line = _one_error_line(p)
    assert "HF_HUB_OFFLINE" in line and "org/tiny-model" in line


def test_hf_token_is_sent(tiny_repo: Path, tmp_path: Path) -> None:
    seen: list[str | None] = []

    class TokenHub(FakeHub):
        async def _info(self, request: web.Request) -> web.Response:
            seen.append(request.headers.get("Authorization"))
            return await super()._info(request)

    with TokenHub({"org/tiny-model": tiny_repo}) as hub:
        p = run_cli(["in=stdin", "out=echo_core", "org/tiny-model"], input="hi",
                    env=_hf_env(hub.url, tmp_path / "hf", HF_TOKEN="hf_test_token_123"), timeout=60)
    assert p.returncode == 0, p.stderr
    assert seen and seen[0] == "Bearer hf_test_token_123"


def test_progress_bar_on_a_terminal(tiny_repo: Path, tmp_path: Path) -> None:
    """With stderr on a terminal, huggingface_hub draws its download progress bar."""
    with FakeHub({"org/tiny-model": tiny_repo}) as hub:
        master, slave = pty.openpty()
        # a fresh pty is 0 columns wide, and tqdm draws nothing in 0 columns
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
        try:
            proc = subprocess.run(
                cli_command() + ["in=stdin", "out=echo_core", "org/tiny-model"],
                input=b"hi", stdout=subprocess.PIPE, stderr=slave, timeout=60,
                env=cli_env(_hf_env(hub.url, tmp_path / "hf")),
            )
            os.close(slave)
            slave = -1
            chunks = []
            while True:
                try:
                    data = os.read(master, 65536)
                except OSError:
                    break
                if not data:
                    break
                chunks.append(data)
        finally:
            if slave != -1:
                os.close(slave)
            os.close(master)
    err = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, err
    assert "Fetching 5 files" in err and "100%" in err, err


def test_only_one_weight_format_is_fetched(tiny_repo: Path, tmp_path: Path) -> None:
    # a repo that carries its weights three times (as many do): only the safetensors are downloaded
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(tiny_repo, repo)
    (repo / "pytorch_model.bin").write_bytes(b"\0" * 4096)
    (repo / "consolidated.safetensors").write_bytes(b"\0" * 4096)
    (repo / "model-q4.gguf").write_bytes(b"GGUF" + b"\0" * 4092)
    home = tmp_path / "hf"
    with FakeHub({"org/tiny-model": repo}) as hub:
        p = run_cli(["in=stdin", "out=echo_core", "org/tiny-model"], input="hello there",
                    env=_hf_env(hub.url, home), timeout=60)
        assert p.returncode == 0, p.stderr
        fetched = [r for r in hub.requests if "/resolve/" in r]
    assert any(r.endswith("/model.safetensors") for r in fetched), fetched
    assert not any(r.endswith(("pytorch_model.bin", "consolidated.safetensors", ".gguf")) for r in fetched), fetched
