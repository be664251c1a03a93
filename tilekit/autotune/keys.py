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


def bucket_distance(a: Mapping, b: Mapping, buckets: Buckets) -> float | None:
    """Log2 distance between two bucketed problems, or None when a non-bucketed field differs."""
    if set(a) != set(b):
        return None
    distance = 0.0
    for k in sorted(a):  # one summation order, so that the distance is symmetric
        if k in buckets:
            if not (isinstance(a[k], int) and isinstance(b[k], int) and a[k] > 0 and b[k] > 0):
                return None
            distance += abs(math.log2(a[k]) - math.log2(b[k]))
        elif a[k] != b[k]:
            return None
    return distance


def pow2_bucket(n: int) -> int:
    """Token counts round up to a power of two: 1, 2, 4, ..., 8192, ..."""
    return pow2_ceil(n)
