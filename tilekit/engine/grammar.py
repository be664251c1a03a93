"""Structured output: a request's response_format compiled by llguidance into a matcher over the checkpoint's
vocabulary; each step the matcher's allowed tokens become the request's row of a bitmask that
tilekit.kernels.token_bitmask puts on the logits before penalties and the pick, and the picked token advances it.

Formats (OpenAI's response_format, and the forms vLLM's guided_* fields map to):
    {"type": "text"}                                  no constraint
    {"type": "json_object"}                           any JSON object
    {"type": "json_schema", "json_schema": {"schema": {...}, ...}}    (or {"type": "json_schema", "schema": {...}})
    {"type": "regex", "regex": "..."}
    {"type": "grammar", "grammar": "..."}             a Lark grammar (llguidance's), or GBNF (llama.cpp's, with ::=)
    {"type": "choice", "choice": ["a", "b", ...]}

llguidance rather than xgrammar: it installs with no dependencies (xgrammar needs torch, transformers and triton),
covers JSON schema, regular expressions and Lark / GBNF grammars through one matcher, and computes a mask in tens of
microseconds (its own measure; see docs/serving.md). A runner builds its vocabulary once (Runner.constraint).
"""

from __future__ import annotations

import json
import threading

import numpy as np

from tilekit.kernels.token_bitmask import words

FORMATS = ("text", "json_object", "json_schema", "regex", "grammar", "choice")
COMPACT = {"whitespace_flexible": False}    # JSON as OpenAI writes it: ", " and ": " only (a schema's x-guidance wins)
_lock = threading.Lock()


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ValueError("response_format needs llguidance: pip install 'tilekit[structured]'") from None
    return llguidance


def grammar_of(response_format, check: bool = True) -> str | None:
    """The llguidance grammar of a response_format (module doc), None for plain text; a ValueError naming the field
    for anything malformed, and with `check` for a grammar whose syntax llguidance refuses (Constraint checks it
    against the vocabulary, which covers the syntax too)."""
    grammar = _grammar(response_format)
    if check and grammar is not None:
        error = _llguidance().LLMatcher.validate_grammar(grammar)
        if error:
            raise ValueError(f"response_format: {error}")
    return grammar


def _grammar(response_format) -> str | None:
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise ValueError(f"response_format must be an object with a 'type' (one of {', '.join(FORMATS)}), got "
                         f"{type(response_format).__name__}")
    kind = response_format["type"]
    if kind == "text":
        return None
    matcher = _llguidance().LLMatcher
    if kind == "json_object":
        return matcher.grammar_from_json_schema({"type": "object"}, COMPACT)
    if kind == "json_schema":
        spec = response_format.get("json_schema", response_format)
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema must be a JSON schema (an object, or true)")
        try:
            return matcher.grammar_from_json_schema(json.dumps(schema), COMPACT)
        except (ValueError, TypeError) as e:
            raise ValueError(f"response_format.json_schema.schema: {e}") from None
    if kind == "regex":
        pattern = response_format.get("regex")
        if not isinstance(pattern, str) or not pattern:
            raise ValueError("response_format.regex must be a non-empty string")
        return matcher.grammar_from_regex(pattern)
    if kind == "grammar":
        text = response_format.get("grammar")
        if not isinstance(text, str) or not text.strip():
            raise ValueError("response_format.grammar must be a non-empty Lark or GBNF grammar")
        if "::=" in text:
            try:
                from llguidance.gbnf_to_lark import gbnf_to_lark
                text = gbnf_to_lark(text)
            except Exception as e:  # noqa: BLE001 - the converter's own parse errors
                raise ValueError(f"response_format.grammar: not a GBNF grammar llguidance reads: {e}") from None
        return matcher.grammar_from_lark(text)
    if kind == "choice":
        choices = response_format.get("choice")
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("response_format.choice must be a non-empty list of non-empty strings")
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in dict.fromkeys(choices)))
    raise ValueError(f"response_format.type must be one of {', '.join(FORMATS)}, got {kind!r}")


def vocabulary(tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]):
    """llguidance's view of a tokenizer (a tokenizer.json's text) over a model's vocab_size ids (up to about a second
    for a large vocabulary: build it once)."""
    eos = list(eos_token_ids) if eos_token_ids else None
    return _llguidance().LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)


_executor = None


def _threads():
    """llguidance's thread pool (made once)."""
    global _executor
    with _lock:
        if _executor is None:
            _executor = _llguidance().LLExecutor()
    return _executor


def fill_masks(pairs, out: np.ndarray) -> None:
    """Row i of `out` (a C-contiguous (rows, words) int32 array) the allowed tokens of its Constraint, for each
    (constraint, i) of `pairs`, computed in parallel on llguidance's threads; none (every row stopped): `out` as
    it is (llguidance refuses an empty batch)."""
    if out.dtype != np.int32 or out.ndim != 2 or not out.flags["C_CONTIGUOUS"]:
        raise ValueError("out must be a C-contiguous (rows, words) int32 array")
    if not pairs:
        return
    _threads().unsafe_compute_mask_ptr([(c.matcher, i) for c, i in pairs], out.ctypes.data, out.shape[1] * 4,
                                       out.shape[0])


_host_thread = None


def in_background(fn, *args):
    """fn(*args) on structured output's own host thread (llguidance releases the GIL while it works, so the engine's
    Python goes on meanwhile); returns its concurrent.futures.Future. One thread: jobs run in the order given."""
    global _host_thread
    with _lock:
        if _host_thread is None:
            from concurrent.futures import ThreadPoolExecutor
            _host_thread = ThreadPoolExecutor(1, thread_name_prefix="tilekit-grammar")
    return _host_thread.submit(fn, *args)


def accept_tokens(pairs) -> list[bool]:
    """Constraint.accept(token) of each (constraint, token) of `pairs`, in parallel on llguidance's threads when
    there are several (a step of 64 constrained requests took about 1 ms one by one)."""
    if len(pairs) < 2:
        return [c.accept(t) for c, t in pairs]
    return [bool(ok) for ok in _threads().consume_token_par([(c.matcher, int(t)) for c, t in pairs])]


class Constraint:
    """One request's matcher: mask() its allowed next tokens, accept(token) the pick."""

    def __init__(self, vocab, grammar: str, vocab_size: int, matcher=None):
        """The matcher of `grammar` (or a copy of another's, `matcher`) over `vocab`; a ValueError naming
        response_format if the grammar does not fit the vocabulary."""
        llg = _llguidance()
        if matcher is None:
            error = llg.LLMatcher.validate_grammar(grammar, vocab)
            if error:
                raise ValueError(f"response_format: {error}")
            matcher = llg.LLMatcher(vocab, grammar, log_level=0)
            if matcher.is_error():
                raise ValueError(f"response_format: {matcher.get_error()}")
        self.vocab, self.grammar, self.vocab_size, self.matcher = vocab, grammar, vocab_size, matcher
        self.words = words(vocab_size)

    def copy(self) -> "Constraint":
        """A fresh matcher in this one's state (no grammar compile)."""
        return Constraint(self.vocab, self.grammar, self.vocab_size, self.matcher.deep_copy())

    def mask(self) -> np.ndarray:
        """The int32 bitmask row (vocab_size / 32 words) of the tokens the grammar allows next."""
        row = np.zeros((1, self.words), np.int32)
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        return row[0]

    def accept(self, token: int) -> bool:
        """Advance past the picked token; False when the matcher refuses it (it is then in an error state: a parser
        limit reached, or a token its mask did not allow), which ends only this request."""
        return bool(self.matcher.consume_token(int(token)))

    @property
    def done(self) -> bool:
        """The grammar is complete (nothing but an end token may follow), or the matcher failed."""
        return self.matcher.is_stopped()


def constraint_masks(constraints: list, done: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """(rows, words) bitmasks of generate()'s rows, into `out` if given: each running row's allowed tokens, a stopped
    row's all ones."""
    masks = np.empty((len(constraints), constraints[0].words), np.int32) if out is None else out
    masks.fill(-1)
    fill_masks([(constraints[b], b) for b in np.flatnonzero(~done)], masks)
    return masks


def constraints_took(constraints: list, tokens, running: np.ndarray, stops) -> None:
    """Each row that was running takes its new token; a row whose grammar is now complete, or whose matcher refused
    the token, stops (StopChecker)."""
    rows = np.flatnonzero(running)
    for b, ok in zip(rows, accept_tokens([(constraints[b], int(tokens[b])) for b in rows])):
        if not ok or constraints[b].done:
            stops.done[b] = True


def ends_only(mask: np.ndarray, eos_token_ids) -> bool:
    """Whether a bitmask row allows nothing but end tokens (its grammar complete): such a row is not held to
    min_new_tokens, whose eos ban would leave it no token. (Word by word: the row with its eos bits cleared is
    empty; not a set of the allowed ids, which at a 128K vocabulary took milliseconds a row.)"""
    row = np.asarray(mask).view(np.uint32)
    rest = row.copy()
    for e in eos_token_ids:
        if 0 <= e < 32 * len(rest):
            rest[e // 32] &= ~np.uint32(1 << (e % 32))
    return bool(row.any()) and not rest.any()
