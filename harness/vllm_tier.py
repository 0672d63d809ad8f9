"""What the vLLM tier's tests share: their marks, the startup allowance, vLLM's cache folders, running a
worker or server for a module, a KV-routing frontend that waits until it sees the worker, random prompts.

vLLM takes 20-60 s to start here (a cold machine: imports, the engine process, the weights), so a test
module starts its servers once; these helpers make every module start and stop them the same way.
"""

from __future__ import annotations

import importlib.util
import random
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import pytest

from harness.proc import DynamoRun, DynamoWorker
from harness.wait import wait_until

STARTUP_TIMEOUT = 420.0


def vllm_tier(timeout: float = 600) -> list[pytest.MarkDecorator]:
    """A vLLM tier module's ``pytestmark``: marked ``vllm``, skipped without vLLM, ``timeout`` s a test."""
    return [pytest.mark.vllm,
            pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                               reason="vLLM is not installed here (the tier runs in .venv-vllm: scripts/test-vllm.sh)"),
            pytest.mark.timeout(timeout)]


def vllm_cache_env(cache: Path) -> dict[str, str]:
    """The environment that puts vLLM's and torch inductor's caches under ``cache`` (not the user's home)."""
    return {"VLLM_CACHE_ROOT": str(cache / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}


@contextmanager
def serving(srv: DynamoRun, what: str) -> Iterator[DynamoRun]:
    """``srv`` started (its startup time printed) and, after the module, stopped with exit status 0."""
    started = time.monotonic()
    with srv:
        print(f"\n{what} up in {time.monotonic() - started:.1f} s")
        yield srv
    assert srv.returncode == 0, srv.stderr_text()[-4000:]


@contextmanager
def running(worker: DynamoWorker) -> Iterator[DynamoWorker]:
    """``worker`` started and ready; stopped after (vLLM alone takes 5-10 s to shut down on a busy machine)."""
    try:
        worker.start()
        yield worker
    finally:
        worker.stop(timeout=60)


@contextmanager
def kv_frontend(env: dict[str, str], sees_worker: Callable[[DynamoRun], object], what: str) -> Iterator[DynamoRun]:
    """An ``in=http out=dyn --router-mode kv`` frontend, yielded once ``sees_worker(frontend)`` holds."""
    fe = DynamoRun("out=dyn", "--router-mode", "kv", env=env).start()
    try:
        wait_until(lambda: sees_worker(fe), 60, what)
        yield fe
    finally:
        fe.stop()


def words(n: int, seed: int) -> str:
    """``n`` random four-letter words (no two prompts share a prefix by chance), the same for one ``seed``."""
    rng = random.Random(seed)
    return " ".join("".join(rng.choice("abcdefghij") for _ in range(4)) for _ in range(n))
