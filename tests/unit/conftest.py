"""Unit tests need no engine and no network: each gets a tight wall clock."""

from __future__ import annotations

import pytest

UNIT_TIMEOUT_S = 60


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        # only unit tests (this hook sees the whole session's items), and never
        # loosening a test's own tighter marker
        if "tests/unit/" in item.nodeid and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(UNIT_TIMEOUT_S))
