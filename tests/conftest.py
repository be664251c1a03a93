"""Shared test setup: every test gets its own empty user tuning cache, and tests marked `gpu` skip with the
reason where no usable CUDA GPU is present. `no_hang`: a test that blocks for 20 s (a FIFO opened) fails.
With TESTS_SPREAD_OVER_GPUS=N (scripts/gpu-tests.sh sets it on a host with N GPUs), pytest-xdist worker k runs on
GPU k mod N; HOST_GPUS then says how many the host has (the processes a multi-GPU test starts may see them all).
With TESTS_FAILURES_FILE=PATH each failure's report is appended there as it happens (a run cut short by a time
limit keeps the messages that pytest prints only at its end)."""

import os
import signal

import pytest

from tilekit.autotune import store

_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
HOST_GPUS = 0         # with the spread: the host's GPU count, of which this worker sees one
if _WORKER.startswith("gw") and os.environ.get("TESTS_SPREAD_OVER_GPUS", "").isdigit() \
        and "CUDA_VISIBLE_DEVICES" not in os.environ:       # before anything starts CUDA in this worker
    HOST_GPUS = max(1, int(os.environ["TESTS_SPREAD_OVER_GPUS"]))
    os.environ["CUDA_VISIBLE_DEVICES"] = str(int(_WORKER[2:]) % HOST_GPUS)


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    from tilekit.device import gpu_unavailable_reason
    reason = gpu_unavailable_reason()
    if reason:
        skip = pytest.mark.skip(reason=f"GPU test: {reason}")
        for item in gpu_items:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    path = os.environ.get("TESTS_FAILURES_FILE")
    if path and report.failed and not _WORKER:         # once: where xdist runs, its controller writes it
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEKIT_CACHE_DIR", str(tmp_path / "tilekit-cache"))
    store.reset()
    yield tmp_path / "tilekit-cache"
    store.reset()


@pytest.fixture
def no_hang():
    def blocked(*_):
        raise TimeoutError("blocked for 20 s")
    previous = signal.signal(signal.SIGALRM, blocked)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)
