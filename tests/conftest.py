"""The layout rule every test follows: tests/unit/ needs no server, tests/e2e/ holds exactly the
tests marked `e2e` (each of its modules sets `pytestmark = pytest.mark.e2e`). The real servers
are tests/support/servers.py's, the fixtures on them tests/e2e/conftest.py's."""

from __future__ import annotations

from pathlib import Path

import pytest

E2E = Path(__file__).resolve().parent / "e2e"


def pytest_itemcollected(item: pytest.Item) -> None:
    under_e2e = E2E in item.path.resolve().parents
    if under_e2e != (item.get_closest_marker("e2e") is not None):
        raise pytest.UsageError(f"{item.nodeid}: tests/e2e/ holds exactly the e2e-marked tests")
