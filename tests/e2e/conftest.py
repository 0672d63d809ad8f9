"""The distributed configurations (harness/dist_configs.py) as a module-scoped, parametrized fixture."""

from __future__ import annotations

from typing import Iterator

import pytest

from harness.dist_configs import DIST_CONFIGS, DistConfig
from harness.dist_configs import dist_config as start_dist_config


@pytest.fixture(scope="module", params=DIST_CONFIGS)
def dist_config(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DistConfig]:
    with start_dist_config(request.param, tmp_path_factory.mktemp("dist")) as config:
        yield config
