"""Whether a stored tuning entry may be used: the one rule for dispatch, `db import` and `db verify`."""

from __future__ import annotations

import math

from tilekit.autotune.db import entry_problem
from tilekit.autotune.keys import parse_key
from tilekit.autotune.registry import registered_ops

MAX_TIME_US = 10 ** 12     # an integer time beyond this is no measurement (and a 400-digit one overflows float())


def bad_time(value) -> str | None:
    """Why a measured time is unusable (not a number, not finite, negative), or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "is not a number"
    if isinstance(value, int) and abs(value) > MAX_TIME_US:
        return "is out of range"
    if isinstance(value, float) and not math.isfinite(value):
        return "is not finite"
    return "is negative" if value < 0 else None


def entry_defect(key: str, entry) -> str | None:
    """Why an entry can never be used by this tilekit (malformed, unknown kernel, a key the kernel does
    not make, a config outside the space it claims to be tuned over or, other than the key's default config, one
    that space's rule refuses for the key, a bad time), or None."""
    problem = entry_problem(key, entry)
    if problem:
        return problem
    name, fields = parse_key(key)
    op = registered_ops().get(name)
    if op is None:
        return f"unknown kernel {name!r}"
    try:
        canonical = op.problem_key(fields)[1] == key
    except (KeyError, TypeError, ValueError):   # a field missing, or of a type its bucket cannot take
        canonical = False
    if not canonical:
        return f"key is not a {name} problem key"
    errors = op.problem_errors(fields)          # as a problem named on the command line is checked
    if errors:
        return f"key field {errors[0]}"
    if entry["space_hash"] == op.space_hash():      # (tuned over another space: stale, not broken)
        config = entry["config"]
        if not op.space.contains(config):
            return f"config outside the {name} search space"
        tuning = op.complete(fields)            # its tuning_problem: the fields of a canonical key are bucketed
        if not op.space.admits(config, tuning) and config != op.default(tuning):     # the tuner times the default
            return f"config the {name} search space's rule refuses for its key"
    for field in ("time_us", "default_time_us"):
        why = None if field != "time_us" and entry.get(field) is None else bad_time(entry.get(field))
        if why:
            return f"{field} {why}"
    return None


def entry_reason(key: str, entry, layer: str) -> str | None:
    """None when the entry may be used now from `layer` ("user" or "shipped"), else the reason: a
    defect (entry_defect) or staleness."""
    return entry_defect(key, entry) or staleness(key, entry, layer)


def staleness(key: str, entry, layer: str) -> str | None:
    """Why an entry without defects is stale in `layer` (the op's why_unusable: kernel, space, toolchain), or None."""
    return registered_ops()[parse_key(key)[0]].why_unusable(entry, layer)
