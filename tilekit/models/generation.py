"""What a generate call is asked to do, and the float64 reference of how each next token is chosen.

SamplingParams (per batch row) and GenerationSettings (a call's lengths, stop rules, seed and sampling, with a
checkpoint's generation_config.json as defaults); process_logits / sample_reference, the NumPy float64
reference of logit processing and sampling that the GPU sampler is tested against; StopChecker, the stop rules.

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
from typing import Callable, Sequence

import numpy as np

from tilekit.kernels.next_token import next_token_reference
from tilekit.checkpoints import CONFIG_NAME, Checkpoint, Fields, ModelFileError
from tilekit.untrusted import quoted
from tilekit.models.text import TextStream, tokenizer_failures

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


# -- stopping ------------------------------------------------------------------------------------------

class StopChecker:
    """Which rows of a batch have stopped, fed each step's new tokens (and their decoded text).

    A row stops after the token that (a) is one of the eos ids, (b) completes a stop string in the row's
    decoded continuation, or (c) is its max_new_tokens-th; that token is kept. Rows stop independently and
    tokens given for a stopped row are ignored. As in HF, min_new_tokens is not a stop rule: process_logits
    keeps eos from being generated before it. Stop strings follow HF's StopStringCriteria: a match is the
    string occurring in the text, ending within the newest token's text (so a token running past the string,
    "st" + "opped" for "stop", also stops), but here only the continuation's text is searched, never the prompt.
    """

    def __init__(self, batch: int, settings: GenerationSettings):
        if settings.max_new_tokens is None:
            raise ValueError("max_new_tokens must be set to check stops")
        self.settings = settings
        self.eos = np.array(settings.eos_token_ids, np.int64)
        self.lengths = np.zeros(batch, np.int64)       # tokens each row keeps
        self.done = np.full(batch, settings.max_new_tokens == 0)
        self.tails = [""] * batch        # the last characters of each row's text that a stop string can span
        self.keep = max(map(len, settings.stop_strings), default=1) - 1

    def update(self, tokens: Sequence[int], pieces: Sequence[str] | None = None) -> None:
        """Take one step's (B,) new tokens and, with stop strings, the text each one printed (TextStream.push)."""
        tokens = np.asarray(tokens, np.int64)
        if tokens.shape != self.done.shape:
            raise ValueError(f"tokens must have shape {self.done.shape}, got {tokens.shape}")
        if self.settings.stop_strings and (pieces is None or len(pieces) != len(tokens)):
            raise ValueError("stop strings need each row's decoded text piece")
        for b in np.flatnonzero(~self.done):
            self.lengths[b] += 1
            stop = self.lengths[b] == self.settings.max_new_tokens or bool(np.isin(tokens[b], self.eos))
            if self.settings.stop_strings:
                text = self.tails[b] + pieces[b]
                stop |= any(s in text for s in self.settings.stop_strings)
                self.tails[b] = text[-self.keep:] if self.keep else ""
            self.done[b] = stop

    @property
    def all_done(self) -> bool:
        return bool(self.done.all())


# -- the generation API every model shares ---------------------------------------------------------

class TextGeneration:
    """What a model that generates offers besides generate() itself, shared by the GPU models (runtime.CausalLM)
    and the NumPy references: the checkpoint's defaults, one resolution of generate()'s arguments, text in and
    out with exact streaming, and chat through the checkpoint's template. A model sets `config` (vocab_size,
    block_size, eos_token_id) and `checkpoint` (a checkpoints.Checkpoint; None without one)."""

    checkpoint: Checkpoint | None = None
    rope_positions: int | None = None     # positions the model's rotary tables cover (None: no tables)

    @property
    def context_length(self) -> int:
        """The longest sequence the model runs: block_size, or fewer where its rotary tables stop."""
        return min(self.config.block_size, self.rope_positions or self.config.block_size)

    def context_limit_message(self) -> str:
        """How the context length is set, for errors."""
        if self.context_length == self.config.block_size:
            return f"block_size {self.config.block_size}"
        return f"the {self.context_length} positions of the rotary tables (block_size {self.config.block_size})"

    def generation_defaults(self) -> GenerationSettings:
        """What generate() does unless told otherwise: the checkpoint's generation_config.json read as Hugging
        Face reads it (greedy unless it says do_sample), with config.json's eos ids; greedy for a model
        without a checkpoint directory."""
        eos = getattr(self.config, "eos_token_id", None)
        if self.checkpoint is not None:
            return GenerationSettings.from_generation_config(self.checkpoint, config_eos=eos,
                                                             vocab_size=self.config.vocab_size)
        return GenerationSettings(eos_token_ids=() if eos is None else eos, sampling=SamplingParams(temperature=0.0))

    def generation_plan(self, prompts: Sequence[np.ndarray], max_new_tokens: int | None,
                        sampling: Sequence[SamplingParams] | None, **explicit):
        """(settings, one SamplingParams per row, one TextStream per row when stop strings need the text, else
        None) of a generate() call on `prompts`: explicit arguments over generation_defaults(), every one
        checked (ValueError naming it) before anything runs."""
        scalars = {k: explicit[k] for k in SAMPLING_FIELDS}
        if sampling is not None and any(v is not None for v in scalars.values()):
            raise ValueError("pass sampling= (one SamplingParams per row) or the scalar sampling arguments, not both")
        settings = self.generation_defaults().override(max_new_tokens=max_new_tokens, **explicit)
        rows = per_row(settings.sampling if sampling is None else list(sampling), len(prompts))
        if settings.max_new_tokens is None:
            raise ValueError("max_new_tokens must be given (the checkpoint's generation_config.json sets none)")
        V, longest = self.config.vocab_size, max(len(p) for p in prompts)
        if any(e >= V for e in settings.eos_token_ids):
            raise ValueError(f"eos_token_id must lie in [0, {V}), got {list(settings.eos_token_ids)}")
        if longest + settings.max_new_tokens > self.context_length:
            given = "" if max_new_tokens is not None else " (generation_config.json's)"
            raise ValueError(f"prompt length {longest} + max_new_tokens {settings.max_new_tokens}{given} "
                             f"exceeds {self.context_limit_message()}")
        streams = None
        if settings.stop_strings:
            tokenizer, source = self.tokenizer(), self._tokenizer_file()
            streams = [TextStream(tokenizer, context=[int(t) for t in p], source=source) for p in prompts]
        return settings, rows, streams

    def tokenizer(self):
        """The checkpoint's tokenizer (tokenizer.json, or GPT-2's vocab.json + merges.txt), read as untrusted."""
        from tilekit.models.text import load_tokenizer
        if self.checkpoint is None:
            raise ValueError("this model has no checkpoint directory to read a tokenizer from (load it with "
                             "from_pretrained)")
        return load_tokenizer(self.checkpoint)

    def generate_text(self, prompt: str | Sequence[str], max_new_tokens: int | None = None, *,
                      stream_to: Callable[[str], None] | None = None, chat: bool = False,
                      **kwargs) -> str | list[str]:
        """Tokenize `prompt` (or a list of prompts, one batch) with the checkpoint's tokenizer, generate
        (kwargs as for generate()), and return the continuation's text; stream_to(piece) receives it
        piece by piece as it is made (one prompt only): the pieces concatenate to exactly the returned
        text, characters that span tokens included. chat=True sends each prompt as one user message
        through the checkpoint's chat template (see chat())."""
        single = isinstance(prompt, str)
        texts = [prompt] if single else list(prompt)
        if not texts or not all(isinstance(t, str) for t in texts):
            raise ValueError("prompt must be a string or a non-empty list of strings")
        if stream_to is not None and not single:
            raise ValueError("stream_to streams one prompt; pass a string, or no stream_to for a batch")
        if chat:
            ids = [self._chat_ids([{"role": "user", "content": t}]) for t in texts]
        else:
            ids = [self._encoded(t) for t in texts]
        out = self._continue_text(ids, max_new_tokens, stream_to, kwargs)
        return out[0] if single else out

    def chat(self, messages: Sequence[dict], max_new_tokens: int | None = None, *,
             stream_to: Callable[[str], None] | None = None, **kwargs) -> str:
        """The assistant's reply to `messages` ([{"role": "system" | "user" | "assistant" | "tool",
        "content": ...}, ...]), the conversation rendered with the checkpoint's chat template as Hugging
        Face's apply_chat_template renders it; kwargs as for generate()."""
        return self._continue_text([self._chat_ids(messages)], max_new_tokens, stream_to, kwargs)[0]

    def chat_template(self):
        """The checkpoint's chat template (chat_template.jinja or tokenizer_config.json's chat_template);
        ValueError when it has none."""
        from tilekit.models.text import chat_template
        template = None if self.checkpoint is None else chat_template(self.checkpoint)
        if template is None:
            raise ValueError("this checkpoint has no chat template (tokenizer_config.json's chat_template or "
                             "chat_template.jinja)")
        return template

    def _chat_ids(self, messages: Sequence[dict]) -> list[int]:
        """Token ids of `messages` rendered with the chat template (which writes its own special tokens)."""
        return self._encoded(self.chat_template().render(messages), add_special_tokens=False)

    def _encoded(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` by the checkpoint's tokenizer; a tokenizer that fails on it, or makes an id past the
        model's vocabulary, is a ModelFileError naming the checkpoint's tokenizer (its file is untrusted)."""
        tokenizer = self.tokenizer()
        with tokenizer_failures(self._tokenizer_file(), "cannot encode the prompt"):
            ids = tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        V = self.config.vocab_size
        if any(i >= V for i in ids):
            raise ModelFileError(self._tokenizer_file(), f"makes token id {max(ids)}, past the model's vocabulary "
                                                         f"of {V} (config.json's vocab_size)")
        return ids

    def _tokenizer_file(self):
        """The file the checkpoint's tokenizer was read from (tokenizer.json, else vocab.json): what errors name."""
        return self.checkpoint.directory / ("tokenizer.json" if self.checkpoint.has("tokenizer.json") else
                                            "vocab.json")

    def _continue_text(self, ids: list[list[int]], max_new_tokens: int | None, stream_to, kwargs) -> list[str]:
        """The decoded continuations of prompts `ids`, row 0's streamed to stream_to as it is made."""
        if not all(ids):
            raise ValueError("prompt encodes to no tokens")
        tokenizer, source = self.tokenizer(), self._tokenizer_file()
        streams = [TextStream(tokenizer, context=i, source=source) for i in ids]
        on_token = None
        if stream_to is not None:
            def on_token(tokens):
                piece = streams[0].push(tokens[0])
                if piece:
                    stream_to(piece)
        seqs = self.generate(ids, max_new_tokens, on_token=on_token, **kwargs)
        for b, (stream, seq) in enumerate(zip(streams, seqs)):
            if stream_to is None or b > 0:
                for t in seq[len(ids[b]):]:
                    stream.push(t)
            rest = stream.flush()
            if stream_to is not None and b == 0 and rest:
                stream_to(rest)
        return [s.printed for s in streams]


def generate_by_recomputation(model, prompts: Sequence[np.ndarray], settings: GenerationSettings,
                              rows: Sequence[SamplingParams], streams, step_logits: Callable,
                              on_token: Callable | None) -> list[np.ndarray]:
    """generate() without a KV cache or a GPU, for the NumPy references: each step's logits come from
    step_logits(sequences) (recomputing every prefix), are processed by process_logits and sampled by
    sample_reference with one generator seeded from settings.seed; the stop rules as on the GPU."""
    B, V = len(prompts), model.config.vocab_size
    seqs = [list(int(t) for t in p) for p in prompts]
    rng = np.random.default_rng(settings.seed)
    stops = StopChecker(B, settings)
    pad = settings.eos_token_ids[0] if settings.eos_token_ids else 0
    for step in range(settings.max_new_tokens):
        outputs = [s[len(p):] for s, p in zip(seqs, prompts)]
        processed = process_logits(step_logits(seqs), token_counts(seqs, V), token_counts(outputs, V), rows, step,
                                   eos_token_ids=settings.eos_token_ids, min_new_tokens=settings.min_new_tokens)
        tokens = np.where(stops.done, pad, sample_reference(processed, rng))
        for s, t in zip(seqs, tokens):
            s.append(int(t))
        stops.update(tokens, None if streams is None else [st.push(t) for st, t in zip(streams, tokens)])
        if on_token is not None:
            on_token(tokens)
        if stops.all_done:
            break
    return [np.asarray(s[:len(p) + n], np.int64) for s, p, n in zip(seqs, prompts, stops.lengths)]
