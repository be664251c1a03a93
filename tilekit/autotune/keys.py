"""Problem keys: which tuned result applies to a call (op, dtype, shape bucket)."""

from __future__ import annotations

import math
import re
from typing import Callable, Mapping

from tilekit.autotune.space import pow2_ceil

Buckets = Mapping[str, Callable[[int], int]]

_INT = re.compile(r"-?[0-9]+")  # what parse_key reads back as an int


def bucket_problem(problem: Mapping[str, object], buckets: Buckets) -> dict:
    """The problem with its bucketed dimensions rounded to their bucket."""
    return {k: (buckets[k](v) if k in buckets else v) for k, v in problem.items()}


def key_string(op: str, problem: Mapping[str, object]) -> str:
    """Canonical text key, e.g. 'linear/K=768,M=8192,N=2304,dtype=bfloat16'."""
    if not op or "/" in op or not problem:
        raise ValueError(f"cannot key op {op!r} with problem {dict(problem)!r}")
    for k, v in problem.items():
        if not isinstance(v, (int, str)) or isinstance(v, bool) or any(c in str(v) for c in ",=/") \
                or (isinstance(v, str) and _INT.fullmatch(v)):
            raise ValueError(f"problem field {k}={v!r} must be an int or a plain string")
        if not isinstance(k, str) or not k or any(c in k for c in ",=/"):
            raise ValueError(f"problem field name {k!r} must be a plain non-empty string")
    return op + "/" + ",".join(f"{k}={problem[k]}" for k in sorted(problem))


def parse_key(key: str) -> tuple[str, dict]:
    """Inverse of key_string; ints come back as ints."""
    op, _, rest = key.partition("/")
    if not op or not rest:
        raise ValueError(f"malformed tuning key {key!r}")
    problem = {}
    for item in rest.split(","):
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"malformed tuning key {key!r}")
        problem[name] = int(value) if _INT.fullmatch(value) else value
    return op, problem


EXACT, NEAREST_BUCKET, NEAREST_SHAPE = "exact", "nearest bucket", "nearest shape"
RULES = (EXACT, NEAREST_BUCKET, NEAREST_SHAPE)     # the lookup's rules, best first
BUCKET_REACH = 3.0     # log2: a bucket more than 8x away is far (an H100 M=128 config ran a TP=2 rank's M=8192 prefill
                       # 1.8x slower than the H200's exact entry for M=8192, session 25)


def search_tier(distance: tuple) -> int:
    """The lookup's passes over the GPUs of an arch, in order: 0 the exact key or a bucket within BUCKET_REACH, 1 a
    farther bucket, 2 a nearest shape (of a key_distance)."""
    rule, _, bucket = distance
    return 2 if rule == 2 else 1 if bucket > BUCKET_REACH else 0


def key_distance(a: Mapping, b: Mapping, buckets: Buckets, sizes: frozenset | set = frozenset()) -> tuple | None:
    """How far stored key fields `b` lie from a problem's key fields `a`, or None when one may not answer the other.

    (rule index into RULES, log2 distance over the unbucketed size fields, log2 distance over the bucketed ones):
    every field other than a size (bucketed fields and `sizes`) must be equal, and differing sizes must be positive
    ints. Comparing these tuples orders answers exact, then nearest bucket (nearest first), then nearest shape
    (nearest unbucketed sizes first, e.g. N and K, then the nearest bucket, e.g. M).
    """
    if a.keys() != b.keys():
        return None
    shape = bucket = 0.0
    for k in sorted(a):  # one summation order, so that the distance is symmetric
        x, y = a[k], b[k]
        if x == y:
            continue
        if k not in buckets and k not in sizes:
            return None
        if type(x) is not int or type(y) is not int or x <= 0 or y <= 0:
            return None
        d = abs(math.log2(x) - math.log2(y))
        if k in buckets:
            bucket += d
        else:
            shape += d
    rule = 0 if shape == bucket == 0 else 1 if shape == 0 else 2
    return rule, shape, bucket


def pow2_bucket(n: int) -> int:
    """Token counts round up to a power of two: 1, 2, 4, ..., 8192, ..."""
    return pow2_ceil(n)
