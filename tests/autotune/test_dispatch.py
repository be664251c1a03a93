"""Dispatch on CPU: TILEKIT_AUTOTUNE modes, the launch-plan cache, reset, pinned configs, auto mode."""

import threading
import warnings

import pytest

import tilekit.autotune.op as op_module
from tests._autotune_fakes import DEFAULT, H100, call_config, entry, make_op, problem
from tilekit.autotune import store, tuner
from tilekit.autotune.arrays import MetaArray
from tilekit.autotune.db import TuningDB, TuningDBWarning

TUNED = {"A": 4, "occupancy": 2}


@pytest.fixture(autouse=True)
def fake_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(op_module, "device_info", lambda index=None: H100)
    monkeypatch.setenv("TILEKIT_SHIPPED_DB", str(tmp_path / "shipped"))
    (tmp_path / "shipped").mkdir()
    monkeypatch.delenv("TILEKIT_AUTOTUNE", raising=False)
    store.reset()


@pytest.fixture
def op():
    op = make_op()
    store.user_db().store(H100, {op.problem_key(problem(M=1000))[1]: entry(op, TUNED)})
    return op


def test_cached_is_the_default_mode_and_uses_the_db(op):
    assert call_config(op) == TUNED
    assert op.resolve(problem(M=1000), H100).source == "user"
    assert op.hinted(TUNED) is op.hinted(dict(TUNED)) and op.kernel.hint_calls == [{"occupancy": 2}]


def test_cached_explicit(op, monkeypatch):
    monkeypatch.setenv("TILEKIT_AUTOTUNE", " Cached ")
    store.reset()
    assert call_config(op) == TUNED


def _no_io(*args, **kwargs):
    raise AssertionError("the tuning database was consulted")


def test_off_returns_the_default_even_with_an_entry(op, monkeypatch):
    monkeypatch.setenv("TILEKIT_AUTOTUNE", "off")
    store.reset()
    monkeypatch.setattr(store, "layers", _no_io)   # off does not even look
    assert call_config(op) == DEFAULT
    assert op.resolve(problem(M=1000), H100).source == "default"


def test_invalid_mode_raises(op, monkeypatch):
    monkeypatch.setenv("TILEKIT_AUTOTUNE", "sometimes")
    store.reset()
    with pytest.raises(ValueError, match="TILEKIT_AUTOTUNE"):
        call_config(op)
    with pytest.raises(ValueError, match="TILEKIT_AUTOTUNE"):
        op.resolve(problem(), H100)
    monkeypatch.setenv("TILEKIT_AUTOTUNE", "cached")
    assert call_config(op) == TUNED   # the failure was not cached


def test_no_entry_gives_the_default():
    assert call_config(make_op()) == DEFAULT


def test_plan_is_cached_per_call_signature(op, monkeypatch):
    x = MetaArray((1000, 768), "bfloat16", device=0)
    first, _ = op.plan_for((x,))
    monkeypatch.setattr(store, "layers", _no_io)
    monkeypatch.setattr(op_module, "device_info", _no_io)
    for _ in range(3):
        assert op.plan_for((MetaArray((1000, 768), "bfloat16", device=0),))[0] is first
    for other in [MetaArray((1001, 768), "bfloat16", device=0), MetaArray((1000, 768), "float16", device=0),
                  MetaArray((1000, 768), "bfloat16", device=1), x.transpose(1, 0).transpose(1, 0)[::2]]:
        with pytest.raises(AssertionError, match="consulted"):   # another signature: the slow path
            op.plan_for((other,))


def test_a_nearest_shape_is_resolved_once_per_plan(op, monkeypatch):
    """An untuned shape borrows the nearest tuned one on the plan's first call; later calls only hit the cache."""
    lookups, lookup = [], TuningDB.lookup
    monkeypatch.setattr(TuningDB, "lookup", lambda db, *a, **k: lookups.append(db.layer) or lookup(db, *a, **k))
    first = op.plan_for((MetaArray((1000, 1024), "bfloat16", device=0),))[0]
    assert first.config == TUNED and lookups == ["user", "shipped"]
    assert op.resolve(problem(M=1000, N=1024), H100).match.rule == "nearest shape"
    monkeypatch.setattr(store, "layers", _no_io)
    monkeypatch.setattr(op_module, "device_info", _no_io)
    for _ in range(3):
        assert op.plan_for((MetaArray((1000, 1024), "bfloat16", device=0),))[0] is first


def test_dry_run_arrays_record_without_consulting_anything(op, monkeypatch):
    monkeypatch.setattr(store, "layers", _no_io)
    monkeypatch.setattr(op_module, "device_info", _no_io)
    with op_module.recording() as calls:
        plan, _ = op.plan_for((MetaArray((1000, 768), "bfloat16"),))
    assert plan.config == DEFAULT and calls == [(op, problem(M=1000))]


def test_plans_per_device(op, monkeypatch):
    seen = []
    monkeypatch.setattr(op_module, "device_info", lambda index=None: seen.append(index) or H100)
    for _ in range(3):
        call_config(op, device=0)
        call_config(op, device=1)
    assert seen == [0, 1]


def test_reset_forgets(op):
    assert call_config(op, M=5000) == TUNED       # nearest bucket (M=1024)
    store.user_db().store(H100, {op.problem_key(problem(M=5000))[1]: entry(op, {"A": 2, "occupancy": 1})})
    assert call_config(op, M=5000) == TUNED       # still the in-process answer
    store.reset()
    assert call_config(op, M=5000) == {"A": 2, "occupancy": 1}


def test_pinned_forces_a_config_and_restores(op):
    before = op.plan_for((MetaArray((1000, 768), "bfloat16", device=0),))[0]
    forced = {"A": 2, "occupancy": 1}
    with op.pinned(forced):
        for M, N, dtype in [(1000, 768, "bfloat16"), (7, 3, "float16"), (1, 1, "bfloat16")]:
            assert call_config(op, M, N, dtype) == forced
    assert op.plan_for((MetaArray((1000, 768), "bfloat16", device=0),))[0] is before
    assert call_config(op, M=5000) == TUNED     # nearest bucket, not the pin


def test_pinned_restores_after_an_exception(op):
    assert call_config(op) == TUNED
    with pytest.raises(RuntimeError):
        with op.pinned({"A": 1, "occupancy": 2}):
            raise RuntimeError
    assert call_config(op) == TUNED


@pytest.mark.parametrize("bad", [{"A": 3, "occupancy": 1}, {"A": 2}, {"A": 2, "occupancy": 1, "x": 1},
                                 {"A": 2.0, "occupancy": 1}])
def test_pinned_outside_the_space_raises(op, bad):
    with pytest.raises(ValueError, match="search space"):
        with op.pinned(bad):
            pass
    assert call_config(op) == TUNED


def test_pinned_only_affects_its_op(op):
    other = make_op()
    with op.pinned({"A": 1, "occupancy": 1}):
        assert call_config(other) == DEFAULT
    assert call_config(op) == TUNED


def test_reset_inside_pinned_is_not_lost(op):
    assert call_config(op, M=5000) == TUNED          # nearest to M=1024
    with op.pinned({"A": 1, "occupancy": 1}):
        store.user_db().store(H100, {op.problem_key(problem(M=5000))[1]: entry(op, {"A": 2, "occupancy": 1})})
        store.reset()
    assert call_config(op, M=5000) == {"A": 2, "occupancy": 1}


def test_stale_entry_warns_and_dispatches_the_default():
    op = make_op()
    store.user_db().store(H100, {op.problem_key(problem(M=1000))[1]: entry(op, TUNED, kernel_hash="0" * 16)})
    with pytest.warns(TuningDBWarning, match="stale"):
        assert call_config(op) == DEFAULT


# -- auto mode ----------------------------------------------------------------------------------

@pytest.fixture
def auto(monkeypatch):
    monkeypatch.setenv("TILEKIT_AUTOTUNE", "auto")
    store.reset()


def _fake_measurement(monkeypatch, best: dict, calls: list):
    """tune_many stands in for the GPU: it 'measures' `best`, stores it like the tuner, and forgets."""
    def tune_many(items, **kwargs):
        results = []
        for op, p in items:
            calls.append(op.problem_key(p)[1])
            key = op.problem_key(p)[1]
            store.user_db().store(H100, {key: entry(op, best)})
            op.forget()                     # the real tuner does this: no lock may be held here
            results.append(tuner.TuneResult(op.name, key, dict(best), 5.0, DEFAULT, 9.0, 6, 6))
        return results
    monkeypatch.setattr(tuner, "tune_many", tune_many)


def test_auto_tunes_a_missing_key_once_through_a_call(auto, monkeypatch):
    op, calls = make_op(), []
    _fake_measurement(monkeypatch, TUNED, calls)
    done = threading.Event()

    def work():
        assert call_config(op) == TUNED
        assert call_config(op) == TUNED       # the in-process plan
        done.set()

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(20)
    assert done.is_set(), "auto mode deadlocked"
    assert calls == [op.problem_key(problem(M=1000))[1]]
    store.reset()
    assert call_config(op) == TUNED and calls == [op.problem_key(problem(M=1000))[1]]   # stored: not tuned again


def test_auto_falls_back_with_one_warning_when_tuning_fails(auto, monkeypatch):
    op = make_op()
    store.user_db().store(H100, {op.problem_key(problem(M=64))[1]: entry(op, TUNED)})   # a distant bucket

    def broken(items, **kwargs):
        raise RuntimeError("no candidate compiled")
    monkeypatch.setattr(tuner, "tune_many", broken)
    with pytest.warns(TuningDBWarning, match="auto-tuning .* failed .*no candidate compiled.*nearest"):
        assert call_config(op) == TUNED                 # the nearest bucket, not an exception
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert call_config(op, M=1001) == TUNED         # a new signature: no second warning
    monkeypatch.setattr(tuner, "tune_many", lambda items, **kw: [])
    with pytest.warns(TuningDBWarning, match="produced no result"):
        assert call_config(make_op()) == DEFAULT        # nothing stored anywhere: the default


def test_concurrent_first_calls_tune_a_key_once(auto, monkeypatch):
    """Threads missing the same key at once: one tunes, the others wait for its result."""
    op, calls = make_op(), []
    _fake_measurement(monkeypatch, TUNED, calls)
    results = []
    threads = [threading.Thread(target=lambda M=M: results.append(call_config(op, M=M))) for M in range(1000, 1004)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert results == [TUNED] * 4 and calls == [op.problem_key(problem(M=1000))[1]]


def test_a_key_stored_after_a_callers_miss_is_not_tuned_again(auto, monkeypatch):
    """The window between a caller's database miss and its turn to tune: another thread's tuning stored the key
    and ended there, so the caller takes the stored config (seen under load: the key was tuned twice)."""
    op, calls = make_op(), []
    _fake_measurement(monkeypatch, TUNED, calls)
    assert call_config(op, M=1000) == TUNED and len(calls) == 1
    p = op.tuning_problem(problem(M=1000))
    assert op_module._tuning.tune(op, p, op.problem_key(problem(M=1000))[1], H100) == TUNED
    assert len(calls) == 1


def test_a_failed_auto_tune_is_not_retried_for_new_signatures(auto, monkeypatch):
    op, attempts = make_op(), []

    def broken(items, **kwargs):
        attempts.append(1)
        raise RuntimeError("no candidate compiled")
    monkeypatch.setattr(tuner, "tune_many", broken)
    with pytest.warns(TuningDBWarning, match="auto-tuning"):
        assert call_config(op, M=1000) == DEFAULT
    assert call_config(op, M=1001) == DEFAULT and call_config(op, M=1002) == DEFAULT
    assert len(attempts) == 1


def test_a_missing_required_array_is_named():
    op = make_op()
    with pytest.raises(TypeError, match="x must be a CUDA device array .*got None"):
        op.plan_for((None,))


def test_a_plan_built_across_a_forget_is_not_kept(op, monkeypatch):
    """The databases changed while a call was choosing its config: the call runs, its plan is not kept."""
    real = op.resolve

    def resolve_then_forget(*args, **kwargs):
        found = real(*args, **kwargs)
        op.forget()                  # e.g. a tuner in another thread stored a result meanwhile
        return found
    monkeypatch.setattr(op, "resolve", resolve_then_forget)
    assert call_config(op) == TUNED
    assert op._plans == {}


def test_the_first_declaration_of_a_name_stays():
    from tilekit.autotune.registry import registered_ops
    op = make_op()
    again = op_module.Op(op.name, args=op.args, key=dict(dtype=None, M=None, N=None), space=op.space,
                         default=op.default, arrays=op.arrays, launches=op.launches, bind=op.bind)
    assert registered_ops()[op.name] is op and again is not op


def test_recording_sees_only_its_own_thread():
    other = []
    with op_module.recording() as mine:
        t = threading.Thread(target=lambda: other.append(make_op().plan_for((MetaArray((4, 4), "float32"),))))
        t.start()
        t.join()
        make_op().plan_for((MetaArray((8, 4), "float32"),))
    assert len(mine) == 1 and mine[0][1]["M"] == 8 and other


def test_scratch_slots_are_distinct_under_threads():
    from tilekit.autotune import arrays as arr
    from tilekit.autotune.arrays import ArraySpec
    slots = []

    def make(i):
        for j in range(300):
            slots.append(arr.scratch_slot(f"t{i}", 0, (ArraySpec("float32", (j + 1,), role="scratch"),)))

    threads = [threading.Thread(target=make, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(slots)) == len(slots) == 1800
