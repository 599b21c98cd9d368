import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


def pytest_configure(config):
    os.environ.setdefault("RAY_DISABLE_USAGE_STATS", "1")
    os.environ.setdefault("KUBERL_TEST", "1")
