"""config.json read field by field: typed reads that name the file and the field when a value is missing, of the
wrong type or out of range, the rotary-embedding fields transformers 4 and 5 write, and the range checks every
family's config class runs on its arguments."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Callable

import numpy as np

from tilekit.checkpoints.files import CONFIG_NAME, ModelFileError, json_shown, read_json
from tilekit.env import expand_user
from tilekit.untrusted import quoted


REQUIRED = object()


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finite(v) -> bool:
    try:
        return (is_int(v) or isinstance(v, float)) and math.isfinite(float(v))
    except OverflowError:   # an integer beyond a float's range
        return False


def _bounds(low, high) -> str:
    if low is not None and high is not None:
        return f" in [{low}, {high}]"
    return f" >= {low}" if low is not None else f" <= {high}" if high is not None else ""


class Fields:
    """Typed reads of a JSON object from a model file; an error is a ModelFileError naming the file and the
    field (nested ones as 'rope_scaling.factor'). A field may be absent only when a default is given; null counts
    as absent only where the default is None (HF's None). Integers are JSON integers: 2.0 and true are refused,
    as models would index or loop with them. Fields nobody reads are ignored, as HF does."""

    def __init__(self, d: dict, path, prefix: str = ""):
        self.d, self.path, self.prefix = d, path, prefix

    def __contains__(self, key: str) -> bool:
        return key in self.d

    def error(self, key: str, problem: str) -> ModelFileError:
        return ModelFileError(self.path, f"field {quoted(self.prefix + key)} {problem}")

    def _get(self, key: str, default, want: str, ok: Callable[[object], bool]):
        value = self.d.get(key, REQUIRED)
        if value is REQUIRED or (value is None and default is None):
            if default is REQUIRED:
                raise self.error(key, f"is missing, expected {want}")
            return default
        if not ok(value):
            raise self.error(key, f"is {json_shown(value)}, expected {want}")
        return value

    def integer(self, key: str, default=REQUIRED, *, low: int | None = None, high: int | None = None) -> int | None:
        return self._get(key, default, "an integer" + _bounds(low, high), lambda v: is_int(v) and (
            low is None or v >= low) and (high is None or v <= high))

    def number(self, key: str, default=REQUIRED, *, positive: bool = False, low: float | None = None,
               high: float | None = None) -> float | None:
        want = "a finite number" + (" > 0" if positive else "") + _bounds(low, high)
        value = self._get(key, default, want, lambda v: _finite(v) and not (positive and v <= 0) and (
            low is None or v >= low) and (high is None or v <= high))
        return None if value is None else float(value)

    def boolean(self, key: str, default=REQUIRED) -> bool | None:
        return self._get(key, default, "true or false", lambda v: isinstance(v, bool))

    def choice(self, key: str, choices: tuple[str, ...], default=REQUIRED) -> str | None:
        return self._get(key, default, "one of " + ", ".join(map(json.dumps, choices)),
                         lambda v: isinstance(v, str) and v in choices)

    def token_ids(self, key: str, default=REQUIRED, *, vocab: int | None = None) -> int | tuple[int, ...] | None:
        """A token id or a non-empty list of them (an int or a tuple), each in [0, vocab)."""
        def is_id(v):
            return is_int(v) and 0 <= v and (vocab is None or v < vocab)
        want = "a token id or a non-empty list of them (integers " + (f"in [0, {vocab}))" if vocab else ">= 0)")
        value = self._get(key, default, want, lambda v: is_id(v) or (
            isinstance(v, list) and len(v) > 0 and all(map(is_id, v))))
        return tuple(value) if isinstance(value, list) else value

    def variant(self, key: str, default, computes: Callable[[object], bool]):
        """A field that picks a model variant: its value (`default` if absent), unless computes(value) is false."""
        value = self.d.get(key, default)
        if not computes(value):
            raise self.error(key, f"is {json_shown(value)}, a variant tilekit does not compute")
        return value

    def build(self, cls, **kwargs):
        """cls(**kwargs), a ValueError naming this file (a check across fields that the reads did not make)."""
        try:
            return cls(**kwargs)
        except ValueError as e:
            raise ModelFileError(self.path, str(e)) from None

    def object(self, key: str, default=REQUIRED) -> "Fields | None":
        """A nested JSON object, for typed reads of its own fields."""
        value = self._get(key, default, "a JSON object", lambda v: isinstance(v, dict))
        return None if value is None else Fields(value, self.path, f"{self.prefix}{key}.")


def rotary_problem(inv_freq: np.ndarray, dim_field: str, dim: int) -> str | None:
    """Why rotary inverse frequencies cannot rotate, or None: one that is not > 0, or not finite in float32 (as
    transformers computes them; beyond, its angles and logits are NaN)."""
    with np.errstate(over="ignore", invalid="ignore"):
        if not ((inv_freq > 0) & np.isfinite(inv_freq.astype(np.float32))).all():
            return f"gives rotary frequencies that are not finite and > 0 (with {dim_field} {dim})"
    return None


def rope_fields(f: Fields, kinds: dict[str, tuple[str, ...]], theta: float) -> tuple["Fields | None", str, float]:
    """(the RoPE object or None, its rope_type, rope_theta) of a config.json: transformers 4 writes rope_scaling
    (None for plain RoPE) next to rope_theta, 5 writes rope_parameters holding rope_theta. `kinds`: each rope_type
    computed -> the keys it may have; other types and keys are refused, naming them; `theta`: the top-level
    rope_theta (or its default)."""
    rope = f.object("rope_scaling", None) or f.object("rope_parameters", None)
    if rope is None:
        return None, "default", theta
    kind = rope.variant("rope_type" if "rope_type" in rope else "type", "default",
                        lambda v: isinstance(v, str) and v in kinds)
    extra = sorted(set(rope.d) - {"rope_type", "type", "rope_theta", *kinds[kind]})
    if extra:
        rope.variant(extra[0], None, lambda v: False)
    return rope, kind, rope.number("rope_theta", theta, positive=True)


def refuse_rope_theta(f: Fields, rope: "Fields | None", theta: float, problem: str | None) -> None:
    """A ModelFileError naming rope_theta (in the RoPE object where it holds one) if `problem` (the family's
    rope_problem of the config's tables) is set."""
    if problem:
        where = rope if rope is not None and "rope_theta" in rope else f
        raise where.error("rope_theta", f"is {theta}: it {problem}")


def common_fields(f: Fields, vocab: int) -> dict:
    """rms_norm_eps, tie_word_embeddings and the bos / eos token ids of a rotary family's config.json (transformers'
    defaults where absent), as config constructor arguments."""
    return dict(rms_norm_eps=f.number("rms_norm_eps", 1e-6, positive=True),
                tie_word_embeddings=f.boolean("tie_word_embeddings", False),
                bos_token_id=f.integer("bos_token_id", None if "bos_token_id" in f else 1, low=0, high=vocab - 1),
                eos_token_id=f.token_ids("eos_token_id", None if "eos_token_id" in f else 2, vocab=vocab))


MAX_SIZE = 1 << 24         # no model dimension comes near; a config claiming more is refused
MAX_LAYERS = 4096


def check_positive_ints(config, names) -> None:
    """ValueError naming the first of `names` whose value in `config` is not a positive int (bools are not) of
    plausible size (a hostile config must not make the shape checks run for hours)."""
    for name in names:
        value = getattr(config, name)
        if not is_int(value) or value <= 0:
            raise ValueError(f"{type(config).__name__}.{name} must be a positive int, got {value!r}")
        most = MAX_LAYERS if name == "n_layer" else MAX_SIZE
        if value > most:
            raise ValueError(f"{type(config).__name__}.{name} = {value} is larger than any model tilekit runs "
                             f"(at most {most})")


def check_number(owner, name: str, low: float = 0.0) -> None:
    """ValueError unless owner.name is a finite real number greater than `low` (bools are not numbers)."""
    value = getattr(owner, name)
    if not _finite(value) or value <= low:
        raise ValueError(f"{type(owner).__name__}.{name} must be a finite number > {low}, got {value!r}")


def check_token_ids(config) -> None:
    """ValueError unless config.bos_token_id (an id or None) and config.eos_token_id (an id, a non-empty tuple of
    them, or None; a list becomes a tuple) lie in [0, vocab_size)."""
    if isinstance(config.eos_token_id, list):
        object.__setattr__(config, "eos_token_id", tuple(config.eos_token_id))
    eos = config.eos_token_id if isinstance(config.eos_token_id, tuple) else (config.eos_token_id,)
    if not eos or not all(t is None or (is_int(t) and 0 <= t < config.vocab_size)
                          for t in (config.bos_token_id, *eos)) or (len(eos) > 1 and None in eos):
        raise ValueError(f"{type(config).__name__} token ids must be ints in [0, {config.vocab_size}) (eos: one or "
                         f"a non-empty tuple), got bos {config.bos_token_id!r}, eos {config.eos_token_id!r}")


def check_rotary_config(config, scaling_type: type, rope_problem: Callable, dim: int) -> None:
    """ValueError unless a rotary family's config has rms_norm_eps and rope_theta finite and > 0, rope_scaling a
    `scaling_type` or None whose tables rope_problem(dim, rope_theta, rope_scaling) accepts, tie_word_embeddings a
    bool and its token ids in the vocabulary (check_token_ids)."""
    name = type(config).__name__
    check_number(config, "rms_norm_eps")
    check_number(config, "rope_theta")
    if not isinstance(config.rope_scaling, (scaling_type, type(None))):
        raise ValueError(f"{name}.rope_scaling must be a {scaling_type.__name__} or None, got {config.rope_scaling!r}")
    problem = rope_problem(dim, config.rope_theta, config.rope_scaling)
    if problem:
        raise ValueError(f"{name}.rope_theta {config.rope_theta} {problem}")
    if not isinstance(config.tie_word_embeddings, bool):
        raise ValueError(f"{name}.tie_word_embeddings must be a bool, got {config.tie_word_embeddings!r}")
    check_token_ids(config)


class HFConfig:
    """What every family's config class (a frozen dataclass with a from_fields classmethod) shares: reading a
    config.json dict or file, and replace()."""

    @classmethod
    def from_hf_dict(cls, d: dict, source=CONFIG_NAME):
        """from_fields of a config.json dict; messages name `source`."""
        return cls.from_fields(Fields(d, source))

    @classmethod
    def from_json(cls, path):
        return cls.from_fields(read_config(path))

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


def read_config(path) -> "Fields":
    """The fields of a config.json file a user names (outside any checkpoint)."""
    path = expand_user(os.fspath(path), "config path")
    return Fields(read_json(path), path)
