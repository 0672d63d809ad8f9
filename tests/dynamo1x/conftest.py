"""The interop tier: NVIDIA Dynamo 1.6.1's own processes beside ours (scripts/test-dynamo1x.sh).

Every test here is marked ``dynamo1x`` (not in the default run) and skips, with the reason, where the 1.6.1
virtualenv is missing.  Each test gets its own file store, so fleets of different tests never meet.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.dynamo1x import build_tiny_chat_5k, d16_skip_reason
from harness.dynamo1x_kv import fleet_envs


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    reason = d16_skip_reason()
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.dynamo1x)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def tiny_chat_5k(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny ChatML model with 6,000 token ids (1.6.1's mocker emits ids up to 4999)."""
    return build_tiny_chat_5k(tmp_path_factory.mktemp("d16-model"))


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """A file-discovery root of this test's own (``DYN_FILE_KV``)."""
    root = tmp_path / "store"
    root.mkdir()
    return root


@pytest.fixture(params=["file", "etcd"])
def envs(request: pytest.FixtureRequest, store: Path) -> Iterator[tuple[dict[str, str], dict[str, str], Path | None]]:
    """(1.6.1's environment, ours, the file store or None) of one fleet on ``request.param`` discovery (a
    module of KV tests overrides it with event planes too)."""
    with fleet_envs(request.param, store) as fleet:
        yield fleet
