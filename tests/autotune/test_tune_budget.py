"""--budget bounds the timing of one shape too: the tuner checks and times a shape's configs in chunks and starts
no chunk past the deadline, keeping the best of what it timed (a fake clock and a fake search here; on the GPU a
shape of hundreds of configs pays cuTile's front end for each, minutes past a budget checked between shapes)."""

import numpy as np
import pytest

from tilekit.autotune import tuner

pytest.importorskip("cuda.tile")
from cuda.tile.tune import Measurement, TuningResult  # noqa: E402


class Clock:
    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        return self.now


class Case:
    """A bench case timed whole by exhaustive_search (launches None); outputs the same array for every config."""
    launches = None
    grid = args = None

    def __init__(self, clock, step):
        self.clock, self.step, self.checked = clock, step, []

    def outputs(self, config):
        self.clock.now += self.step
        self.checked.append(config["c"])
        return {"y": np.arange(8.0)}


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(tuner, "time", c)
    return c


def fake_search(clock, broken=()):
    """exhaustive_search's stand-in: each call takes 10 s; config c times c + 1 us unless c is in `broken`."""
    calls = []

    def search(configs, stream, grid, kernel, args, hints, quiet):
        calls.append([c["c"] for c in configs])
        clock.now += 10
        ok = [c for c in configs if c["c"] not in broken]
        if not ok:
            raise ValueError("No valid config found in search space.")
        measured = [Measurement(config=c, mean_us=c["c"] + 1.0, error_margin_us=0.0, num_samples=5) for c in ok]
        return TuningResult(best=min(measured, key=lambda m: m.mean_us), successes=tuple(measured),
                            failures=tuple((c, RuntimeError, "bad") for c in configs if c["c"] in broken))
    return search, calls


class Op:
    kernel = None


def test_no_chunk_starts_past_the_deadline_and_the_best_timed_wins(clock, monkeypatch):
    import cuda.tile as ct
    search, calls = fake_search(clock)
    monkeypatch.setattr(ct.tune, "exhaustive_search", search)
    configs = [{"c": c} for c in range(100, 0, -1)]        # the fastest last
    found = tuner.measure(Op(), Case(clock, 0), configs, None, deadline=15.0)
    assert [len(c) for c in calls] == [tuner.MEASURE_CHUNK, tuner.MEASURE_CHUNK]    # started at 0 and 10, not 20
    assert len(found.successes) == 2 * tuner.MEASURE_CHUNK
    assert found.best.config == {"c": 100 - 2 * tuner.MEASURE_CHUNK + 1}
    every = tuner.measure(Op(), Case(clock, 0), configs, None)       # no deadline: every chunk
    assert len(every.successes) == 100 and every.best.config == {"c": 1}


def test_a_chunk_where_nothing_runs_counts_its_configs_as_failures(clock, monkeypatch):
    import cuda.tile as ct
    chunk = tuner.MEASURE_CHUNK
    search, _ = fake_search(clock, broken=set(range(chunk)))
    monkeypatch.setattr(ct.tune, "exhaustive_search", search)
    found = tuner.measure(Op(), Case(clock, 0), [{"c": c} for c in range(chunk + 3)], None)
    assert [m.config["c"] for m in found.successes] == [chunk, chunk + 1, chunk + 2]
    assert len(found.failures) == chunk and found.failures[0][1] is ValueError
    search, _ = fake_search(clock, broken=set(range(5)))
    monkeypatch.setattr(ct.tune, "exhaustive_search", search)
    with pytest.raises(ValueError, match="no config ran"):
        tuner.measure(Op(), Case(clock, 0), [{"c": c} for c in range(5)], None)


def test_agreement_checks_stop_at_the_deadline_after_the_reference(clock):
    case = Case(clock, 1.0)
    reference = {"c": 7}
    configs = [{"c": c} for c in range(10)]                # the reference not first
    kept, wrong = tuner.agreeing(case, configs, reference, runs=1, deadline=3.5)
    assert case.checked[0] == 7 and wrong == []            # the reference's outputs first (clock 1)
    assert kept == [{"c": 7}, {"c": 0}, {"c": 1}, {"c": 2}]    # then one config a second until past 3.5
    kept, _ = tuner.agreeing(Case(clock, 1.0), configs, reference, runs=1)
    assert len(kept) == 10


def test_the_smallest_problems_are_tuned_first():
    """A budget that runs out leaves the prefill shapes, not the decode ones: decode's few rows come first, and a
    problem's position follows the bytes its arrays hold, ties in the order given."""
    import tilekit.kernels  # noqa: F401  (declares the ops)
    from tilekit.autotune.registry import registered_ops
    quant, norm = registered_ops()["quant_linear"], registered_ops()["rms_norm"]
    shape = dict(dtype="bfloat16", N=14336, K=4096, wq="fp8", scale="channel", xq="none", act="swiglu", bias=0, res=0)
    big, small, mid = dict(shape, M=1024, xq="fp8"), dict(shape, M=8), dict(shape, M=128)
    row = dict(dtype="bfloat16", M=1, N=4096, gather=0, res=0, fixed=0)
    items = [(quant, big), (quant, small), (norm, row), (quant, mid), (norm, dict(row))]
    order = tuner.smallest_first(items)
    assert [p for _, p in order] == [row, row, small, mid, big]
    assert order[0][1] is row and tuner.problem_bytes(quant, small) < tuner.problem_bytes(quant, big)
