"""Servers for the HTTP integration tests: ``dynamo-run in=http`` as a real subprocess.

Session-scoped so the suite starts each configuration once; tests that change the server's state
(signals, environment) start their own with :class:`harness.proc.DynamoRun`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from harness.proc import DynamoRun


@pytest.fixture(scope="session")
def full_server() -> Iterator[DynamoRun]:
    """``out=echo_full`` with no model: served as ``echo``."""
    with DynamoRun("out=echo_full", "--model-name", "echo") as srv:
        yield srv


@pytest.fixture(scope="session")
def core_server(tiny_model: Path) -> Iterator[DynamoRun]:
    """``out=echo_core`` on the tiny model folder: served as ``tiny-chat``."""
    with DynamoRun("out=echo_core", str(tiny_model)) as srv:
        yield srv
