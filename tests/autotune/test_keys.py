"""Property tests of problem keys, buckets and search spaces (CPU only)."""

import math
import re
import string

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tilekit.autotune.keys import bucket_problem, key_distance, key_string, parse_key, pow2_bucket
from tilekit.autotune.space import SearchSpace, pow2_ceil, split_hints

settings.register_profile("tilekit", deadline=None, max_examples=150)
settings.load_profile("tilekit")

names = st.text(string.ascii_letters + string.digits + "_", min_size=1, max_size=8)
plain = st.text(string.ascii_letters + string.digits + "_.-", min_size=1, max_size=10)
values = st.one_of(st.integers(-2**40, 2**40), plain)
problems = st.dictionaries(names, values, min_size=1, max_size=6)
anything = st.dictionaries(st.text(max_size=6), st.one_of(st.integers(), st.text(max_size=8)), max_size=5)


# -- key_string / parse_key -------------------------------------------------------------------

@given(op=names, problem=problems)
def test_key_round_trip(op, problem):
    try:
        key = key_string(op, problem)
    except ValueError:   # refused only for strings that would read back as ints
        assert any(isinstance(v, str) and re.fullmatch(r"-?[0-9]+", v) for v in problem.values())
        return
    assert parse_key(key) == (op, problem)
    assert key_string(*parse_key(key)) == key


@given(op=st.text(max_size=8), problem=anything)
def test_key_string_output_always_parses_back(op, problem):
    """Whatever key_string accepts, parse_key inverts exactly (no silent type or field changes)."""
    try:
        key = key_string(op, problem)
    except ValueError:
        return
    assert parse_key(key) == (op, problem)


def test_key_string_is_canonical_and_rejects_separators():
    assert key_string("linear", {"N": 2304, "M": 8192, "dtype": "bfloat16", "K": 768}) == \
        "linear/K=768,M=8192,N=2304,dtype=bfloat16"
    for bad in ({"a": "x,y"}, {"a": "x=y"}, {"a": "x/y"}, {"a": 1.5}, {"a": True}, {"a": None}):
        with pytest.raises(ValueError):
            key_string("op", bad)
    for bad in ("", "op", "op/", "/a=1", "op/a", "op/=1", "op/a=1,b"):
        with pytest.raises(ValueError):
            parse_key(bad)


def test_parse_key_types():
    assert parse_key("op/a=-3,b=x,c=007x,d=--5,e=\u00b2") == \
        ("op", {"a": -3, "b": "x", "c": "007x", "d": "--5", "e": "\u00b2"})
    for ambiguous in ("12", "-3", "007"):   # would come back as an int
        with pytest.raises(ValueError):
            key_string("op", {"dtype": ambiguous})
    for bad_op, bad_problem in (("", {"a": 1}), ("a/b", {"a": 1}), ("op", {}), ("op", {"a,b": 1})):
        with pytest.raises(ValueError):
            key_string(bad_op, bad_problem)


# -- buckets ---------------------------------------------------------------------------------

@given(st.integers(1, 2**48))
def test_pow2_bucket(n):
    b = pow2_bucket(n)
    assert b & (b - 1) == 0 and b >= 1
    assert n <= b < 2 * n
    assert pow2_bucket(b) == b


@given(st.integers(-10, 1))
def test_pow2_ceil_small(n):
    assert pow2_ceil(n) == 1


dims = st.integers(1, 2**31)
bucketed_problems = st.fixed_dictionaries({"M": dims, "K": dims, "L": dims, "N": st.integers(1, 64),
                                           "dtype": st.sampled_from(["bfloat16", "float16"])})
BUCKETS = {"M": pow2_bucket, "K": pow2_bucket, "L": pow2_bucket}


SIZES = {"N"}


def total(d):
    return d[1] + d[2]


@given(bucketed_problems, bucketed_problems)
def test_key_distance_symmetric_and_zero_iff_equal(a, b):
    b = dict(reversed({**b, "dtype": a["dtype"]}.items()))   # another field order
    d = key_distance(a, b, BUCKETS, SIZES)
    assert d is not None and d[1] >= 0 and d[2] >= 0
    assert d == key_distance(b, a, BUCKETS, SIZES)
    assert (d == (0, 0.0, 0.0)) == (a == b)
    assert d[0] == (0 if a == b else 1 if a["N"] == b["N"] else 2)
    assert (d[1] == 0) == (a["N"] == b["N"])


@given(bucketed_problems, bucketed_problems, bucketed_problems)
def test_key_distance_triangle(a, b, c):
    b = {**b, "dtype": a["dtype"]}
    c = {**c, "dtype": a["dtype"]}
    ab, bc, ac = (key_distance(x, y, BUCKETS, SIZES) for x, y in ((a, b), (b, c), (a, c)))
    for part in (1, 2):
        assert ac[part] <= ab[part] + bc[part] + 1e-9


@given(bucketed_problems, bucketed_problems)
def test_key_distance_none_when_another_field_differs(a, b):
    assume(a["N"] != b["N"] or a["dtype"] != b["dtype"])
    assert key_distance(a, b, BUCKETS) is None          # N is no size here
    assert key_distance(b, a, BUCKETS) is None
    assume(a["dtype"] != b["dtype"])
    assert key_distance(a, b, BUCKETS, SIZES) is None


def test_key_distance_edges():
    assert key_distance({"M": 1024}, {"M": 4096}, BUCKETS) == (1, 0.0, 2.0)
    assert key_distance({"M": 1024, "N": 8}, {"M": 4096, "N": 2}, BUCKETS, SIZES) == (2, 2.0, 2.0)
    assert key_distance({"M": 1, "x": 1}, {"M": 1}, BUCKETS) is None        # other fields
    assert key_distance({"M": 0}, {"M": 1}, BUCKETS) is None                 # no log of 0
    assert key_distance({"N": 0}, {"N": 1}, BUCKETS, SIZES) is None
    assert key_distance({"N": True}, {"N": 2}, BUCKETS, SIZES) is None
    assert key_distance({"M": "a"}, {"M": 1}, BUCKETS) is None
    assert key_distance({"N": "a"}, {"N": "a"}, BUCKETS, SIZES) == (0, 0.0, 0.0)
    assert key_distance({}, {}, BUCKETS) == (0, 0.0, 0.0)


@given(st.dictionaries(st.sampled_from("MNK"), st.integers(0, 2**20), min_size=1))
def test_bucket_problem(problem):
    out = bucket_problem(problem, {"M": pow2_bucket})
    assert set(out) == set(problem)
    for k, v in problem.items():
        assert out[k] == (pow2_bucket(v) if k == "M" else v)


# -- search spaces ---------------------------------------------------------------------------

param_values = st.lists(st.integers(1, 512), min_size=1, max_size=4, unique=True).map(tuple)
spaces = st.dictionaries(st.sampled_from(["BM", "BN", "BK", "occupancy", "num_ctas"]), param_values,
                         min_size=1, max_size=4)


def _limit(config, problem):
    return sum(config.values()) <= problem["limit"]


@given(spaces, st.integers(0, 2000))
def test_candidates_are_in_the_space(params, limit):
    space = SearchSpace(_limit, **params)
    cands = space.candidates({"limit": limit})
    everything = list(space)
    assert len(everything) == len(space) == math.prod(len(v) for v in params.values())
    assert all(c in everything and space.contains(c) for c in cands)
    assert cands == [c for c in everything if sum(c.values()) <= limit]
    assert SearchSpace(None, **params).candidates({}) == everything


@given(spaces, st.data())
def test_contains_rejects_what_is_outside(params, data):
    space = SearchSpace(**params)
    config = data.draw(st.sampled_from(list(space)))
    assert space.contains(config)
    name = data.draw(st.sampled_from(sorted(params)))
    assert not space.contains({**config, name: max(params[name]) + 1})
    assert not space.contains({k: v for k, v in config.items() if k != name})
    assert not space.contains({**config, "extra": 1})
    assert not space.contains({**config, name: float(config[name])})   # 2.0 is not a tile size
    assert not space.contains(list(config.items()))
    consts, hints = split_hints(config)
    assert {**consts, **hints} == config and set(hints) <= {"occupancy", "num_ctas"}


@given(spaces, st.data())
def test_digest_changes_with_params(params, data):
    space = SearchSpace(**params)
    assert SearchSpace(**dict(reversed(list(params.items())))).digest() == space.digest()
    name = data.draw(st.sampled_from(sorted(params)))
    changed = [
        {**params, name: params[name] + (max(params[name]) + 1,)},          # a value added
        {**params, name: params[name][:-1]} if len(params[name]) > 1 else None,   # one removed
        {**{k: v for k, v in params.items() if k != name}, name + "x": params[name]},   # renamed
        {**params, "extra_param": (1,)},                                   # a parameter added
    ]
    for other in filter(None, changed):
        assert SearchSpace(**other).digest() != space.digest()
    assert SearchSpace(_limit, **params).digest() != space.digest()


def test_search_space_rejects_bad_params():
    for bad in ((), (1.0,), (True,), ("a",)):
        with pytest.raises(ValueError):
            SearchSpace(A=bad)


@pytest.mark.parametrize("problem", [{"N": 1}, {"N": 3}, {"N": 64}])
def test_space_admits_exactly_its_candidates(problem):
    space = SearchSpace(lambda c, p: c["A"] * c["B"] <= p["N"], A=(1, 2, 4), B=(1, 8))
    others = [{"A": 3, "B": 1}, {"A": 1}, {"A": 1, "B": 1, "C": 1}, {"A": 1.0, "B": 1}, {"A": True, "B": 1}]
    assert [c for c in [*space, *others] if space.admits(c, problem)] == space.candidates(problem)
    assert SearchSpace(A=(1, 2)).admits({"A": 2}, problem)
