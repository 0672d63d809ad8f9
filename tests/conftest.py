"""Shared fixtures: the repo root on sys.path (``tests`` is not a package) and a tiny model folder."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

from harness.tiny_model import build_tiny_hf_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF-style folder ``tiny-chat`` (byte-level BPE, ChatML template, eos <|im_end|>), no weights."""
    return build_tiny_hf_model(tmp_path_factory.mktemp("models"), with_weights=False)
