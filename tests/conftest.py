"""Shared fixtures: the repo root on sys.path (``tests`` is not a package), a tiny model folder, the real
SmolLM2 GGUF (``gguf``: the test is skipped when it or llama-cpp-python is not installed, or the library
cannot decode on this CPU; ``gguf_in_process`` for tests that load llama.cpp themselves), the
distributed configurations (harness/dist_configs.py) as a module-scoped, parametrized fixture, and, as a
pytest plugin, the real etcd and nats-server fixtures of harness/server_fixtures.py (``etcd_server``,
``nats_server``, ``runtime_servers``, ``runtime_env``) for any test that names them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

from typing import Iterator  # noqa: E402

from harness.dist_configs import DIST_CONFIGS, DistConfig  # noqa: E402
from harness.dist_configs import dist_config as start_dist_config  # noqa: E402
from harness.smollm2 import smollm2_gguf_or_skip  # noqa: E402
from harness.tiny_model import build_tiny_hf_model  # noqa: E402

pytest_plugins = ["harness.server_fixtures"]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF-style folder ``tiny-chat`` (byte-level BPE, ChatML template, eos <|im_end|>), no weights."""
    return build_tiny_hf_model(tmp_path_factory.mktemp("models"), with_weights=False)


@pytest.fixture(scope="module")
def gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF (harness/smollm2.py); skips the test when it cannot run."""
    return smollm2_gguf_or_skip()


@pytest.fixture(scope="module")
def gguf_in_process() -> Path:
    """:func:`gguf` for a test that loads llama.cpp in its own process with llama-cpp-python's defaults."""
    return smollm2_gguf_or_skip(in_process=True)


@pytest.fixture(scope="session")
def colour_projector(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The closed-form colour projector for the SmolLM2 GGUF (harness/colour_projector.py), built once."""
    from harness.colour_projector import write_colour_projector

    text = smollm2_gguf_or_skip()
    return write_colour_projector(tmp_path_factory.mktemp("mmproj") / "colour-mmproj.gguf", text)


@pytest.fixture(scope="module", params=DIST_CONFIGS)
def dist_config(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DistConfig]:
    """Each module that uses it runs once per configuration, its fleet started once for each."""
    with start_dist_config(request.param, tmp_path_factory.mktemp("dist")) as config:
        yield config
