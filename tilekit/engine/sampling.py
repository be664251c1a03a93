"""What a generate call or a request is asked to do, and the float64 reference of how each next token is chosen.

SamplingParams (per batch row or request) and GenerationSettings (a call's lengths, stop rules, seed and sampling,
with a checkpoint's generation_config.json as defaults); process_logits / sample_reference, the NumPy float64
reference of logit processing and sampling that the GPU sampler (kernels.next_token) is tested against.

The logit processing follows Hugging Face's order (GenerationMixin._get_logits_processor) for one row of
scores given the tokens seen so far:

1. repetition penalty over every distinct token of prompt + output: score < 0 ? score * p : score / p;
2. presence and frequency penalties (not in HF; OpenAI / vLLM semantics, output tokens only):
   score -= frequency_penalty * count + presence_penalty * (count > 0);
3. min_new_tokens: every eos id -> -inf while fewer than min_new_tokens tokens were generated;
   (1-3 are HF's "processors" and apply to greedy rows too; -inf commutes with them)
4. temperature 0: greedy, the row keeps only its first argmax; otherwise scores / temperature, then
5. top_k: keep scores >= the k-th largest (ties at the threshold kept, as in HF);
6. top_p: on the softmax of what top_k kept, keep a token when the mass of tokens strictly more probable than
   it is < top_p. HF sorts and keeps a prefix of the sorted order with cumulative mass covering top_p, so
   among equal probabilities at the edge it keeps some in sort order; here ties are kept together. On
   tie-free scores both keep the same set;
7. min_p: keep p >= min_p * p_max (after top_k and top_p);
8. sample from the softmax of what is left.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from tilekit.checkpoints import CONFIG_NAME, Checkpoint, Fields, ModelFileError
from tilekit.kernels.next_token import next_token_reference
from tilekit.untrusted import quoted

GENERATION_CONFIG = "generation_config.json"
MAX_EOS_IDS = 1024
MAX_STOP_STRINGS = 64            # a hostile generation_config.json must not make each step's stop check slow
MAX_STOP_STRING_CHARS = 1024
MAX_COUNT = 1 << 30              # a top_k or min_new_tokens beyond any vocabulary or context: the GPU packs them in int32
MIN_SCALE = 1e-6                 # the smallest temperature / repetition penalty: logits divided by it stay finite
MAX_PENALTY = 1e6                # |presence / frequency penalty|: times a count (< 2^30), then / MIN_SCALE, finite in fp32
HF_DEFAULTS = dict(temperature=1.0, top_k=50, top_p=1.0)   # GenerationConfig's global defaults when sampling
FILE_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")   # HF has no other


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _number(name: str, value) -> float:
    """`value` as a finite float; ValueError naming `name` for a bool, a non-number, NaN or an infinity."""
    if not (_is_int(value) or isinstance(value, (float, np.floating))):
        raise ValueError(f"{name} must be a number, got {quoted(value, 100)}")
    try:
        value = float(value)
    except OverflowError:
        value = math.inf
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {quoted(value, 100)}")
    return value


def _count(name: str, value, most: int | None = None) -> int:
    """`value` as an int >= 0 (and <= most); ValueError naming `name` otherwise (bools are not ints)."""
    if not _is_int(value) or value < 0 or (most is not None and value > most):
        raise ValueError(f"{name} must be an int >= 0{'' if most is None else f' and <= {most}'}, "
                         f"got {quoted(value, 100)}")
    return int(value)


@dataclass(frozen=True)
class SamplingParams:
    """How one batch row picks its next token (see the module doc for the order). temperature 0 is greedy;
    top_k 0 or None, top_p 1, min_p 0 or None, repetition_penalty 1 and presence / frequency penalties 0 are
    off. ValueError naming the argument for a value out of range."""

    temperature: float = 1.0
    top_k: int | None = 0
    top_p: float = 1.0
    min_p: float | None = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self):
        def put(name, value):
            object.__setattr__(self, name, value)

        put("temperature", _number("temperature", self.temperature))
        if self.temperature < 0 or 0 < self.temperature < MIN_SCALE:      # 1 / T must stay finite in fp32
            raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_SCALE}, got {self.temperature}")
        put("top_k", _count("top_k", 0 if self.top_k is None else self.top_k, most=MAX_COUNT))
        put("top_p", _number("top_p", self.top_p))
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        put("min_p", _number("min_p", 0.0 if self.min_p is None else self.min_p))
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        put("repetition_penalty", _number("repetition_penalty", self.repetition_penalty))
        if not MIN_SCALE <= self.repetition_penalty <= 1 / MIN_SCALE:
            raise ValueError(f"repetition_penalty must be in [{MIN_SCALE}, {1 / MIN_SCALE:g}] (1 is off), "
                             f"got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            put(name, _number(name, getattr(self, name)))
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:       # -1e308 overflowed every score
                raise ValueError(f"{name} must be in [{-MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 is off), got "
                                 f"{getattr(self, name)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


def per_row(params: SamplingParams | Sequence[SamplingParams], batch: int) -> tuple[SamplingParams, ...]:
    """One SamplingParams per row of a batch: `params` for every row, or a sequence of one per row."""
    if isinstance(params, SamplingParams):
        return (params,) * batch
    if not isinstance(params, (list, tuple)) or len(params) != batch \
            or not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError(f"sampling params must be one SamplingParams or a list of {batch} (one per row), "
                         f"got {quoted(params, 100)}")
    return tuple(params)


def param_arrays(rows: Sequence[SamplingParams]) -> dict[str, np.ndarray]:
    """The rows' parameters as (B,) arrays, one per field (top_k int64, the rest float64), as a batched
    sampler takes them."""
    return {name: np.array([getattr(r, name) for r in rows], np.int64 if name == "top_k" else np.float64)
            for name in SAMPLING_FIELDS}


def _token_ids(name: str, value) -> tuple[int, ...]:
    """An int or a list of ints >= 0 (an eos_token_id as config files write it) as a tuple, repeats dropped."""
    values = value if isinstance(value, (list, tuple)) else [value]
    if len(values) > MAX_EOS_IDS:
        raise ValueError(f"{name} lists more than {MAX_EOS_IDS} ids")
    return tuple(dict.fromkeys(_count(name, v) for v in values))


def _stop_strings(value) -> tuple[str, ...]:
    values = (value,) if isinstance(value, str) else value
    if not isinstance(values, (list, tuple)) or len(values) > MAX_STOP_STRINGS or not all(
            isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in values):
        raise ValueError(f"stop_strings must be a string or a list of at most {MAX_STOP_STRINGS} non-empty strings "
                         f"of at most {MAX_STOP_STRING_CHARS} characters, got {quoted(value, 100)}")
    return tuple(dict.fromkeys(values))


@dataclass(frozen=True)
class GenerationSettings:
    """A generate call's lengths, stop rules, seed and sampling.

    max_new_tokens None leaves the length to the caller; eos_token_ids (an int or a list) and stop_strings (a
    string or a list) are stored as tuples. The constructor's defaults sample at temperature 1 with nothing else
    on; a checkpoint's defaults come from from_generation_config, and the caller's arguments from override().
    """

    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    eos_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None
    sampling: SamplingParams = SamplingParams()

    def __post_init__(self):
        if self.max_new_tokens is not None:
            _count("max_new_tokens", self.max_new_tokens)
        _count("min_new_tokens", self.min_new_tokens, most=MAX_COUNT)
        object.__setattr__(self, "eos_token_ids", _token_ids("eos_token_ids", self.eos_token_ids))
        object.__setattr__(self, "stop_strings", _stop_strings(self.stop_strings))
        if self.seed is not None:
            _count("seed", self.seed, most=2 ** 64 - 1)
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {quoted(self.sampling, 100)}")

    @classmethod
    def from_generation_config(cls, checkpoint, config_eos=None, vocab_size: int | None = None) -> "GenerationSettings":
        """The defaults a checkpoint's generation_config.json sets, as Hugging Face reads them.

        Precedence, highest first: the caller's explicit arguments (override()); the file's fields; for eos
        ids only, config.json's eos_token_id (`config_eos`), used when the file has none; then transformers'
        global defaults. As in HF, the file samples only with "do_sample": true, at its temperature or 1.0 and
        with its top_k or HF's default 50 and its top_p / min_p; otherwise (absent or false) it is greedy
        (temperature 0), its other sampling fields kept for a caller who passes a temperature > 0. Read are
        do_sample, temperature, top_k, top_p, min_p, repetition_penalty, max_new_tokens, min_new_tokens,
        eos_token_id and stop_strings; lengths that count the prompt (max_length, min_length) and every other
        field are ignored, and a null field counts as absent. The file is untrusted: a field of the wrong type
        or range is a ValueError naming the file and the field; with `vocab_size`, so is an eos id outside the
        vocabulary (config.json's naming config.json).
        """
        ck = Checkpoint.at(checkpoint)
        path = ck.directory / GENERATION_CONFIG
        d = {k: v for k, v in (ck.read_json(GENERATION_CONFIG) if ck.has(GENERATION_CONFIG) else {}).items()
             if v is not None}
        try:
            config_eos = () if config_eos is None else _token_ids("eos_token_id", config_eos)
        except ValueError as e:
            raise ModelFileError(ck.directory / CONFIG_NAME, str(e)) from None
        do_sample = d.get("do_sample", False)
        if not isinstance(do_sample, bool):
            raise ModelFileError(path, f"do_sample must be true or false, got {quoted(do_sample, 100)}")
        file_eos = Fields(d, path).token_ids("eos_token_id", None)      # [] refused
        for where, ids in ((ck.directory / CONFIG_NAME, config_eos), (path, () if file_eos is None else file_eos)):
            ids = ids if isinstance(ids, (list, tuple)) else (ids,)
            if vocab_size is not None and any(i >= vocab_size for i in ids):
                raise ModelFileError(where, f"eos_token_id must lie in [0, {vocab_size}) (config.json's vocab_size), "
                                            f"got {quoted(list(ids), 100)}")
        sampling = {**HF_DEFAULTS, **{k: d[k] for k in FILE_SAMPLING_FIELDS if k in d}}
        if not do_sample:
            sampling["temperature"] = 0.0
        try:
            return cls(max_new_tokens=d.get("max_new_tokens"), min_new_tokens=d.get("min_new_tokens", 0),
                       eos_token_ids=config_eos if file_eos is None else _token_ids("eos_token_id", file_eos),
                       stop_strings=d.get("stop_strings", ()),
                       sampling=SamplingParams(**sampling))
        except ValueError as e:
            raise ModelFileError(path, str(e)) from None

    def override(self, **explicit) -> "GenerationSettings":
        """These settings with the caller's arguments applied: any field of GenerationSettings or of
        SamplingParams; None means "not given" (pass top_k=0 / min_p=0 to turn those off)."""
        unknown = set(explicit) - set(SAMPLING_FIELDS) - ({f.name for f in dataclasses.fields(self)} - {"sampling"})
        if unknown:
            raise ValueError(f"unknown generation argument(s): {', '.join(sorted(unknown))}")
        given = {k: v for k, v in explicit.items() if v is not None}
        sampling = {k: given.pop(k) for k in SAMPLING_FIELDS if k in given}
        return dataclasses.replace(self, **given, sampling=dataclasses.replace(self.sampling, **sampling))


# -- the float64 reference --------------------------------------------------------------------------

def token_counts(rows: Sequence[Sequence[int]], vocab_size: int) -> np.ndarray:
    """(B, vocab_size) int64: how often each token occurs in each row of ids."""
    return np.stack([np.bincount(np.asarray(r, np.int64), minlength=vocab_size)[:vocab_size] for r in rows])


def process_logits(logits: np.ndarray, counts: np.ndarray, output_counts: np.ndarray,
                   params: SamplingParams | Sequence[SamplingParams], generated: int, *,
                   eos_token_ids: Sequence[int] = (), min_new_tokens: int = 0) -> np.ndarray:
    """The float64 logits each row samples from, -inf for every token removed (the module doc's steps 1-7).

    logits (B, V) are the model's, finite or -inf; counts (B, V) count each token in prompt + output, and
    output_counts (B, V) in the output only (token_counts); `generated` tokens were generated so far. A
    greedy row keeps only its first argmax, so that the softmax of every row is what it samples from.
    """
    x, counts, output_counts = np.array(logits, np.float64), np.asarray(counts), np.asarray(output_counts)
    if x.ndim != 2 or counts.shape != x.shape or output_counts.shape != x.shape:
        raise ValueError(f"logits, counts and output_counts must share one (B, V) shape, got {x.shape}, "
                         f"{counts.shape} and {output_counts.shape}")
    if np.isnan(x).any() or (x == np.inf).any():
        raise ValueError("logits must be finite or -inf")
    B, V = x.shape
    if any(not 0 <= e < V for e in eos_token_ids):
        raise ValueError(f"eos_token_ids must lie in [0, {V}), got {quoted(tuple(eos_token_ids), 100)}")
    banned = np.full(B, generated < min_new_tokens and len(eos_token_ids) > 0)
    z = next_token_reference(x, counts, output_counts, param_arrays(per_row(params, B)), banned, eos_token_ids)
    empty = np.flatnonzero((z == -np.inf).all(axis=1))
    if len(empty):
        raise ValueError(f"rows {empty.tolist()} have no token left to sample")
    return z


def probabilities(processed: np.ndarray) -> np.ndarray:
    """Row-wise softmax of processed logits (0 where -inf): each row's sampling distribution."""
    top = processed.max(axis=1, keepdims=True)
    if not np.isfinite(top).all():
        raise ValueError(f"rows {np.flatnonzero(~np.isfinite(top[:, 0])).tolist()} have no token left to sample")
    e = np.exp(processed - top)
    return e / e.sum(axis=1, keepdims=True)


def kept_mask(processed: np.ndarray) -> np.ndarray:
    """(B, V) bool: the tokens a row can emit (those processing did not remove)."""
    return processed > -np.inf


def sample_reference(processed: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """(B,) int64: one token per row drawn from softmax(processed), by inverting its CDF at one uniform per
    row (rng.random(B)); a removed token is never drawn."""
    prob = probabilities(processed)
    cdf = np.cumsum(prob, axis=1)
    u = rng.random(len(prob)) * cdf[:, -1]
    last_kept = prob.shape[1] - 1 - np.argmax(prob[:, ::-1] > 0, axis=1)   # where u rounds up to the total
    return np.minimum((cdf <= u[:, None]).sum(axis=1), last_kept).astype(np.int64)
