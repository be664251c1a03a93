"""What every reader of untrusted input shares (model files, tuning databases, the environment): strict JSON, and
how a message shows what a file or a user gave (control characters escaped, cut). Imports nothing of tilekit."""

from __future__ import annotations

import json
import math
import os


def shown(text, limit: int = 4096) -> str:
    """A path or text for a message: control characters escaped as repr() does, cut after `limit` characters."""
    s = os.fspath(text) if isinstance(text, os.PathLike) else str(text)
    cut = s[:limit]
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in cut) + ("..." if len(s) > limit else "")


def quoted(value, limit: int = 200) -> str:
    """repr(value) for a message, escaped: a string (a tensor, shard or revision name) cut after `limit`
    characters inside its quotes, any other value's repr after `limit` characters."""
    if isinstance(value, str):
        return repr(value[:limit]) + ("..." if len(value) > limit else "")
    return shown(repr(value), limit)


def parse_json(raw: bytes | bytearray):
    """Strict JSON from untrusted bytes: UTF-8, no NaN or Infinity, no number beyond a float's range, no repeated
    key (json would silently keep the last); ValueError saying what is wrong."""
    def unique(pairs):
        d = dict(pairs)
        if len(d) < len(pairs):
            seen = set()
            raise ValueError(f"repeated key {quoted(next(k for k, _ in pairs if k in seen or seen.add(k)))}")
        return d

    def constant(name):
        raise ValueError(f"{name} is not a JSON number")

    def finite(text):
        if not math.isfinite(float(text)):
            raise ValueError(f"{text[:30]} is out of range")
        return float(text)

    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=unique, parse_constant=constant, parse_float=finite)
    except UnicodeDecodeError as e:
        raise ValueError(f"not valid JSON (not UTF-8: {e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise ValueError("not valid JSON (nested too deeply)") from None
    except ValueError as e:   # ours above, or an integer beyond Python's digit limit
        raise ValueError(f"not strict JSON ({str(e).partition(':')[0]})") from None
