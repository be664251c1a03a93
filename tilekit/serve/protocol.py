"""The OpenAI API's request fields, checked, as the engine's options; its response and error shapes.

Every field a request sends is checked for its type and range before anything is queued; a bad one is an APIError
(HTTP 400, OpenAI's nested error shape) naming the field. Unknown fields are ignored, as OpenAI's and vLLM's servers
ignore them. The vLLM / SGLang extensions users send (top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
stop_token_ids) are taken too.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field

MAX_STOPS = 16
MAX_N = 16
MAX_STOP_CHARS = 256
MAX_PROMPTS = 64


class APIError(Exception):
    """An error answered with `status` and OpenAI's {"error": {...}} body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, type: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                             413: "invalid_request_error", 503: "service_unavailable"}.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, why: str) -> APIError:
    return APIError(400, f"{param}: {why}", param=param)


def parse_json(raw: bytes) -> dict:
    """A request body: UTF-8 JSON holding an object."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not UTF-8 (byte {e.start})") from None
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except (json.JSONDecodeError, RecursionError, ValueError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _finite(value) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:                  # an integer past float's range
        return False


def _number(body: dict, name: str, low: float, high: float, *, low_open: bool = False):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
        raise bad(name, f"must be a finite number, got {json.dumps(value)[:40]}")
    if value < low or value > high or (low_open and value == low):
        raise bad(name, f"must lie in {'(' if low_open else '['}{low}, {high}], got {value}")
    return float(value)


def _integer(body: dict, name: str, low: int, high: int | None = None):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"must be an integer, got {json.dumps(value)[:40]}")
    if value < low or (high is not None and value > high):
        raise bad(name, f"must be an integer in [{low}, {'...' if high is None else high}], got {value}")
    return value


def _boolean(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(name, f"must be true or false, got {json.dumps(value)[:40]}")
    return value


@dataclass
class Sampling:
    """What one request asks of generation: the engine's options, max_tokens (None: up to the context), n, and
    streaming."""

    options: dict = field(default_factory=dict)
    max_tokens: int | None = None
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    format_field: str = "response_format"     # the field structured output came in (what its errors name)


def parse_sampling(body: dict, vocab_size: int) -> Sampling:
    """The generation fields of a chat or completions request."""
    s = Sampling()
    o = s.options
    for name, low, high, low_open in (("temperature", 0, 2, False), ("top_p", 0, 1, True), ("min_p", 0, 1, False),
                                      ("presence_penalty", -2, 2, False), ("frequency_penalty", -2, 2, False),
                                      ("repetition_penalty", 0, 10, True)):
        value = _number(body, name, low, high, low_open=low_open)
        if value is not None:
            o[name] = value
    top_k = _integer(body, "top_k", -1, vocab_size)
    if top_k is not None:
        o["top_k"] = max(top_k, 0)              # -1 (vLLM) and 0 are off
    seed = _integer(body, "seed", -(1 << 63), (1 << 63) - 1)
    if seed is not None:
        o["seed"] = seed % (1 << 31)
    min_tokens = _integer(body, "min_tokens", 0)
    if min_tokens:
        o["min_new_tokens"] = min_tokens
    for name in ("max_completion_tokens", "max_tokens"):      # the newer name first, as OpenAI reads them
        value = _integer(body, name, 1)
        if value is not None:
            s.max_tokens = value
            break
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops):
            raise bad("stop", "must be a non-empty string or a list of them")
        if len(stops) > MAX_STOPS or any(len(x) > MAX_STOP_CHARS for x in stops):
            raise bad("stop", f"at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters")
        if stops:
            o["stop_strings"] = stops
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size
                                                for t in ids) or len(ids) > 32:
            raise bad("stop_token_ids", f"must be a list of at most 32 token ids in [0, {vocab_size})")
        o["stop_token_ids"] = ids
    o["ignore_eos"] = _boolean(body, "ignore_eos")
    s.n = _integer(body, "n", 1, MAX_N) or 1
    if s.n > 1 and o.get("temperature", 1.0) == 0:
        raise bad("n", "more than one choice needs sampling (temperature > 0): greedy choices would be equal")
    s.stream = _boolean(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad("stream_options", "must be an object")
        s.include_usage = _boolean(options, "include_usage")
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise bad("logprobs", "log probabilities are not returned by this server (its picks are made on the GPU)")
    response_format, field = parse_response_format(body)
    if response_format is not None:
        o["response_format"], s.format_field = response_format, field
    return s


GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "grammar",
          "guided_choice": "choice"}


def parse_response_format(body: dict) -> tuple[dict | None, str | None]:
    """(the engine's response_format (tilekit.engine.grammar), the field it came in) from OpenAI's response_format
    or one of vLLM's guided_* fields (at most one of them); (None, None) for free text. Its grammar is compiled, and
    checked, when the server builds the request's matcher (Runner.constraint)."""
    given = [name for name in ("response_format", *GUIDED) if body.get(name) is not None]
    if len(given) > 1:
        raise bad(given[1], f"give one of response_format and {', '.join(GUIDED)}, not {' and '.join(given)}")
    if not given:
        return None, None
    name, value = given[0], body[given[0]]
    if name == "response_format":
        if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
            raise bad(name, "must be an object whose type is text, json_object or json_schema")
        fmt = value
    elif name == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise bad(name, "must be a JSON schema (an object, or its JSON text)") from None
        fmt = {"type": "json_schema", "json_schema": {"schema": value}}
    else:
        fmt = {"type": GUIDED[name], GUIDED[name]: value}
    return (None, None) if fmt.get("type") == "text" else (fmt, name)


def parse_messages(body: dict) -> list[dict]:
    """The chat's messages: a non-empty list of {"role", "content"} with string content (or text parts)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}]", "must be an object with a string role")
        content = m.get("content")
        if isinstance(content, list):           # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad(f"messages[{i}].content", "only text parts are supported")
            content = "".join(p["text"] for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content", "must be a string or a list of text parts")
        out.append({"role": m["role"], "content": content})
    return out


def parse_prompts(body: dict, vocab_size: int) -> list[str | list[int]]:
    """A completions prompt: a string, a list of strings, a list of token ids, or a list of lists of them."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            prompts = list(prompt)
        elif all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            prompts = [prompt]
        elif all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
                 for p in prompt):
            prompts = list(prompt)
        else:
            raise bad("prompt", "must be a string, a list of strings, a list of token ids or a list of such lists")
        if len(prompts) > MAX_PROMPTS:
            raise bad("prompt", f"at most {MAX_PROMPTS} prompts a request")
        for p in prompts:
            if isinstance(p, list) and not all(0 <= t < vocab_size for t in p):
                raise bad("prompt", f"token ids must lie in [0, {vocab_size})")
        return prompts
    raise bad("prompt", "must be a non-empty string, list of strings, list of token ids or list of such lists")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def envelope(kind: str, rid: str, model: str, choices: list, usage_: dict | None = None) -> dict:
    """A response or stream chunk: kind is "chat.completion", "chat.completion.chunk" or "text_completion"."""
    out = {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": choices}
    if usage_ is not None or not kind.endswith("chunk"):
        out["usage"] = usage_
    return out
