"""Unit tests need no engine and no network: each gets a tight wall clock."""

from __future__ import annotations

from pathlib import Path

import pytest

UNIT_TIMEOUT_S = 60


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        # only unit tests (this hook sees the whole session's items), and never
        # loosening a test's own tighter marker
        if "tests/unit/" in item.nodeid and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(UNIT_TIMEOUT_S))



@pytest.fixture(scope="session")
def _session_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("xdg-cache")


@pytest.fixture(autouse=True)
def _own_holds_dir(_session_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Image-use holds live in one per-user directory (runner.isolation.image_use): a unit
    test's holds of made-up image ids go to a directory of the session, never ~/.cache."""
    monkeypatch.setenv("CYCLEBOX_HOLDS_DIR", str(_session_cache / "image-use"))
