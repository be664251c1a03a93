"""Shared test setup: every test gets its own empty user tuning cache."""

import pytest

from tilekit.autotune import store


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEKIT_CACHE_DIR", str(tmp_path / "tilekit-cache"))
    store.reset()
    yield tmp_path / "tilekit-cache"
    store.reset()
