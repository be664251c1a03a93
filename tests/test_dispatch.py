"""Dispatch on CPU: TILEKIT_AUTOTUNE modes, the in-process plan cache, reset and pinned configs."""

import pytest

import tilekit.autotune.op as op_module
from tests._autotune_fakes import DEFAULT, H100, entry, make_op, problem
from tilekit.autotune import store
from tilekit.autotune.db import TuningDBWarning

TUNED = {"A": 4, "occupancy": 2}
KEY = (0, "bfloat16", 1000, 768)   # (device index, dtype, M, N): M=1000 is in bucket 1024


@pytest.fixture(autouse=True)
def fake_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(op_module, "device_info", lambda index=None: H100)
    monkeypatch.setenv("TILEKIT_SHIPPED_DB", str(tmp_path / "shipped"))
    monkeypatch.delenv("TILEKIT_AUTOTUNE", raising=False)
    store.reset()


@pytest.fixture
def op():
    op = make_op()
    store.user_db().store(H100, {op.problem_key(problem(M=1000))[1]: entry(op, TUNED)})
    return op


def test_cached_is_the_default_mode_and_uses_the_db(op):
    plan = op.plan(KEY)
    assert plan.config == TUNED
    assert plan.constants == {"A": 4}            # hints are not kernel constants
    assert op.kernel.hint_calls == [{"occupancy": 2}]
    assert op.resolve(problem(M=1000), H100).source == "user"


def test_cached_explicit(op, monkeypatch):
    monkeypatch.setenv("TILEKIT_AUTOTUNE", " Cached ")
    store.reset()
    assert op.plan(KEY).config == TUNED


def test_off_returns_the_default_even_with_an_entry(op, monkeypatch):
    monkeypatch.setenv("TILEKIT_AUTOTUNE", "off")
    store.reset()
    monkeypatch.setattr(store, "layers", _no_io)   # off does not even look
    assert op.plan(KEY).config == DEFAULT
    assert op.resolve(problem(M=1000), H100).source == "default"


def test_invalid_mode_raises(op, monkeypatch):
    monkeypatch.setenv("TILEKIT_AUTOTUNE", "sometimes")
    store.reset()
    with pytest.raises(ValueError, match="TILEKIT_AUTOTUNE"):
        op.plan(KEY)
    with pytest.raises(ValueError, match="TILEKIT_AUTOTUNE"):
        op.resolve(problem(), H100)
    monkeypatch.setenv("TILEKIT_AUTOTUNE", "cached")
    assert op.plan(KEY).config == TUNED   # the failure was not cached


def test_no_entry_gives_the_default():
    op = make_op()
    plan = op.plan(KEY)
    assert plan.config == DEFAULT and plan.constants == {"A": 1}


def _no_io(*args, **kwargs):
    raise AssertionError("the tuning database was consulted")


def test_plan_is_cached_in_process(op, monkeypatch):
    first = op.plan(KEY)
    monkeypatch.setattr(store, "layers", _no_io)
    monkeypatch.setattr(op_module, "device_info", _no_io)
    for _ in range(3):
        assert op.plan(KEY) is first
    with pytest.raises(AssertionError, match="consulted"):   # another key goes to the slow path
        op.plan((0, "bfloat16", 1001, 768))


def test_plan_caches_per_key_and_device(op, monkeypatch):
    calls = []
    monkeypatch.setattr(op_module, "device_info", lambda index=None: calls.append(index) or H100)
    for _ in range(3):
        op.plan(KEY)
        op.plan((1,) + KEY[1:])
    assert calls == [0, 1]


def test_reset_forgets(op):
    other = (0, "bfloat16", 5000, 768)
    assert op.plan(other).config == TUNED       # nearest bucket (M=1024)
    store.user_db().store(H100, {op.problem_key(problem(M=5000))[1]: entry(op, {"A": 2, "occupancy": 1})})
    assert op.plan(other).config == TUNED       # still the in-process answer
    store.reset()
    assert op.plan(other).config == {"A": 2, "occupancy": 1}


def test_pinned_forces_a_config_and_restores(op):
    before = op.plan(KEY)
    forced = {"A": 2, "occupancy": 1}
    with op.pinned(forced):
        for key in (KEY, (0, "float16", 7, 3), (3, "bfloat16", 1, 1)):
            plan = op.plan(key)
            assert plan.config == forced and plan.constants == {"A": 2}
    assert op.plan(KEY) is before
    assert op.plan((0, "bfloat16", 5000, 768)).config == TUNED     # nearest bucket, not the pin


def test_pinned_restores_after_an_exception(op):
    before = op.plan(KEY)
    with pytest.raises(RuntimeError):
        with op.pinned({"A": 1, "occupancy": 2}):
            raise RuntimeError
    assert op.plan(KEY) is before


@pytest.mark.parametrize("bad", [{"A": 3, "occupancy": 1}, {"A": 2}, {"A": 2, "occupancy": 1, "x": 1},
                                 {"A": 2.0, "occupancy": 1}])
def test_pinned_outside_the_space_raises(op, bad):
    before = op.plan(KEY)
    with pytest.raises(ValueError, match="search space"):
        with op.pinned(bad):
            pass
    assert op.plan(KEY) is before


def test_pinned_only_affects_its_op(op):
    other = make_op()
    with op.pinned({"A": 1, "occupancy": 1}):
        assert other.plan(KEY).config == DEFAULT
    assert op.plan(KEY).config == TUNED


def test_reset_inside_pinned_is_not_lost(op):
    other = (0, "bfloat16", 5000, 768)
    assert op.plan(other).config == TUNED          # nearest to M=1024
    with op.pinned({"A": 1, "occupancy": 1}):
        store.user_db().store(H100, {op.problem_key(problem(M=5000))[1]: entry(op, {"A": 2, "occupancy": 1})})
        store.reset()
    assert op.plan(other).config == {"A": 2, "occupancy": 1}


def test_stale_entry_warns_and_dispatches_the_default(monkeypatch):
    op = make_op()
    store.user_db().store(H100, {op.problem_key(problem(M=1000))[1]: entry(op, TUNED, kernel_hash="0" * 16)})
    with pytest.warns(TuningDBWarning, match="stale"):
        assert op.plan(KEY).config == DEFAULT
