"""Text around a model: a checkpoint's tokenizer and chat template, and incremental detokenization.

Every file read here comes from a stranger's checkpoint and is opened through checkpoints.Checkpoint: a regular file of
bounded size that stays inside the checkpoint directory; a bad one is a ValueError naming it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Iterator, Mapping, Sequence

from tilekit.checkpoints import Checkpoint, ModelFileError
from tilekit.untrusted import quoted, shown

MAX_TOKENIZER_BYTES = 64 << 20   # tokenizer.json of a 256k vocabulary is ~35 MB
MAX_TEMPLATE_CHARS = 1 << 20     # real chat templates are a few kB to a few tens of kB
MAX_TEMPLATE_STEPS = 1 << 18     # loop iterations and calls in one render; real templates make tens to thousands
MAX_TEMPLATE_VALUE = 1 << 24     # items of any value a render makes (string, list), bits of an integer; its output
MAX_TEMPLATE_ITEMS = 1 << 27     # items of all the values one render makes (many values kept in variables)
MAX_WRAPPED_CHARS = 1 << 15      # wordwrap's input: Python's textwrap takes ~40 us a character at width 1
RENDERING_FILTERS = frozenset({"tojson", "string", "pprint", "urlencode", "xmlattr", "e", "escape", "forceescape",
                               "safe", "list", "format"})     # filters whose result spells out the whole value
ROLES = ("system", "user", "assistant", "tool")
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")    # a byte-fallback token (SentencePiece, Llama-2)
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


# -- tokenizer -------------------------------------------------------------------------------------

@contextlib.contextmanager
def tokenizer_failures(path, doing: str):
    """What the tokenizers library raises within the block for a file it cannot handle, as one ModelFileError naming
    `path` ("<doing> (<its message>)"): plain Exceptions, and Rust panics (pyo3's PanicException is a BaseException,
    past `except Exception`: a Precompiled normalizer with a bad charsmap, an empty Replace regex)."""
    try:
        yield
    except PASSED_ON:
        raise
    except BaseException as e:  # noqa: BLE001 - the panics above
        raise tokenizer_error(path, doing, e) from None


PASSED_ON = (KeyboardInterrupt, SystemExit, GeneratorExit)


def tokenizer_error(path, doing: str, e: BaseException) -> ModelFileError:
    """tokenizer_failures' error for `e`."""
    return ModelFileError(path, f"{doing} ({shown(str(e).strip(), 300)})")


def load_tokenizer(checkpoint):
    """The `tokenizers.Tokenizer` of a checkpoint (a checkpoints.Checkpoint or its directory): tokenizer.json, or else
    vocab.json + merges.txt (GPT-2's byte-level BPE, with the special tokens tokenizer_config.json names
    registered as special)."""
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.decoders import ByteLevel as ByteLevelDecoder
    from tokenizers.models import BPE
    from tokenizers.pre_tokenizers import ByteLevel

    ck = Checkpoint.at(checkpoint)
    if ck.has("tokenizer.json"):
        text = ck.read_text("tokenizer.json", MAX_TOKENIZER_BYTES)
        with tokenizer_failures(ck.directory / "tokenizer.json", "is not a tokenizer"):
            tok = Tokenizer.from_str(text)
        tok.no_truncation()      # as transformers encodes by default: a file's truncation / padding unused
        tok.no_padding()
        return tok
    if not (ck.has("vocab.json") and ck.has("merges.txt")):
        raise FileNotFoundError(f"{shown(ck.directory)}: no tokenizer.json or vocab.json + merges.txt")
    vocab = ck.read_json("vocab.json")
    merges = _merges(ck.read_text("merges.txt", MAX_TOKENIZER_BYTES), ck.directory / "merges.txt")
    with tokenizer_failures(ck.directory / "vocab.json", "and merges.txt are not a BPE tokenizer"):
        tok = Tokenizer(BPE(vocab, merges))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tok.decoder = ByteLevelDecoder()
    specials = [t for t in special_tokens(ck).values() if tok.token_to_id(t) is not None]
    tok.add_special_tokens([AddedToken(t, special=True) for t in dict.fromkeys(specials)])
    return tok


def _merges(text: str, path) -> list[tuple[str, str]]:
    """The merges of a merges.txt as the tokenizers library reads them: a "#version" line skipped, then one pair
    per line, its two tokens separated by one space."""
    lines = text.split("\n")
    merges = []
    for n, line in enumerate(lines[:-1] if lines[-1] == "" else lines, 1):
        line = line.removesuffix("\r")
        if line.startswith("#version"):
            continue
        pair = line.split(" ")
        if len(pair) != 2:
            raise ModelFileError(path, f"line {n} is {quoted(line, 100)}, expected two tokens separated by a space")
        merges.append((pair[0], pair[1]))
    return merges


def special_tokens(checkpoint) -> dict[str, str]:
    """bos_token, eos_token, ... of a checkpoint's tokenizer_config.json (each a string or {"content": string}),
    as transformers hands them to a chat template; {} without the file."""
    ck, name = Checkpoint.at(checkpoint), "tokenizer_config.json"
    config = ck.read_json(name) if ck.has(name) else {}
    tokens = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if value is None:
            continue
        if not isinstance(value, str):
            raise ModelFileError(ck.directory / name, f"{key} must be a string or an object with a string "
                                                      f"'content', got {quoted(config[key], 100)}")
        tokens[key] = value
    return tokens


class TextStream:
    """Incremental detokenization: push() token ids one at a time and get the text they complete.

    The pieces, with flush() at the end, concatenate to exactly
    tokenizer.decode(context + ids)[len(tokenizer.decode(context)):], that is tokenizer.decode(ids) without a
    context, for any ids. Each step decodes a short window, ids[prefix:], and returns what it adds to the
    window's already returned part ids[prefix:read] (the vLLM / DecodeStream method), so a decoder's rules for
    the start of a text (a SentencePiece decoder drops the first token's leading space) apply as in one whole
    decode. Text is held back while it may still change: while the window's text ends in U+FFFD (a character
    whose bytes span tokens: an accent, CJK character or emoji prints whole) and while the newest decoded token
    is a <0xXX> byte token (a byte-fallback decoder turns a whole run of them into U+FFFDs if the run ends
    invalid). flush() returns what is held and ends the stream. `context` (the prompt's ids, ending on a
    character boundary as an encoded prompt does) makes the first new token decode as it would after the
    prompt: with its leading space. `source`: the tokenizer's file, which a decoder that fails, or that changes text
    already returned, is a ModelFileError naming.
    """

    def __init__(self, tokenizer, *, skip_special_tokens: bool = True, context: Sequence[int] = (),
                 source="the tokenizer"):
        self.tokenizer, self.skip, self.source = tokenizer, skip_special_tokens, source
        self.hidden = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special and skip_special_tokens}
        self.ids = [int(i) for i in context]
        self.prefix, self.read, self.window = 0, len(self.ids), None
        self.start = len(self._decode(0))   # the context's own text
        self.printed = ""

    def _decode(self, start: int, stop: int | None = None) -> str:
        try:            # tokenizer_failures without its context manager, which cost a third of a push
            return self.tokenizer.decode(self.ids[start:stop], skip_special_tokens=self.skip)
        except PASSED_ON:
            raise
        except BaseException as e:  # noqa: BLE001 - Rust panics, as tokenizer_failures says
            raise tokenizer_error(self.source, "cannot decode the generated tokens", e) from None

    def push(self, token_id: int) -> str:
        """The text that token_id completes ('' while it is held back)."""
        token_id = int(token_id)
        self.ids.append(token_id)
        if token_id in self.hidden or BYTE_TOKEN.fullmatch(self.tokenizer.id_to_token(token_id) or ""):
            return ""
        if self.window is None:           # the returned part's text, kept while text is held back
            self.window = self._decode(self.prefix, self.read)
        before, now = self.window, self._decode(self.prefix)
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        piece = now[len(before):]
        self.prefix, self.read, self.window = self.read, len(self.ids), None
        self.printed += piece
        return piece

    def flush(self) -> str:
        """The text not yet returned; after it the pieces add up to the whole decode (see the class doc)."""
        text = self._decode(0)[self.start:]
        if not text.startswith(self.printed):    # a decoder whose rules reach back across tokens
            raise ModelFileError(self.source, "has a decoder that rewrites text already printed: the whole decode "
                                              f"{quoted(text, 100)} does not start with it")
        rest, self.printed = text[len(self.printed):], text
        return rest


# -- chat templates --------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChatTemplate:
    """A checkpoint's chat template, the file it came from and the special tokens it is rendered with."""

    text: str
    source: str
    special_tokens: Mapping[str, str] = field(default_factory=dict)

    def render(self, messages: Sequence[Mapping], add_generation_prompt: bool = True) -> str:
        return render_chat(self.text, messages, self.special_tokens, add_generation_prompt, source=self.source)


def chat_template(checkpoint) -> ChatTemplate | None:
    """The chat template of a checkpoint (a checkpoints.Checkpoint or its directory), found as transformers finds it:
    chat_template.jinja, else tokenizer_config.json's chat_template (a string, or a list of {"name", "template"}
    whose "default" is used); None if the checkpoint has none."""
    ck = Checkpoint.at(checkpoint)
    tokens = special_tokens(ck)
    if ck.has("chat_template.jinja"):
        return ChatTemplate(ck.read_text("chat_template.jinja", MAX_TEMPLATE_CHARS),
                            shown(ck.directory / "chat_template.jinja"), tokens)
    name = "tokenizer_config.json"
    value = (ck.read_json(name) if ck.has(name) else {}).get("chat_template")
    where = f"{shown(ck.directory / name)}: chat_template"
    if value is None:
        return None
    if isinstance(value, list):
        if not all(isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
                   for t in value):
            raise ValueError(f"{where} must be a string or a list of {{'name': str, 'template': str}}")
        named = {t["name"]: t["template"] for t in value}
        if "default" not in named:
            raise ValueError(f"{where} names no 'default' template (it has {quoted(sorted(named), 100)})")
        value, where = named["default"], where + "['default']"
    if not isinstance(value, str):
        raise ValueError(f"{where} must be a string, got {type(value).__name__}")
    if len(value) > MAX_TEMPLATE_CHARS:
        raise ValueError(f"{where} is longer than {MAX_TEMPLATE_CHARS} characters")
    return ChatTemplate(value, where, tokens)


def render_chat(template: str, messages: Sequence[Mapping], special_tokens: Mapping[str, str] | None = None,
                add_generation_prompt: bool = True, *, source: str = "chat template") -> str:
    """The prompt text of `messages` ([{"role", "content"}, ...], roles system / user / assistant / tool) as
    transformers' apply_chat_template(tokenize=False) renders it: a sandboxed Jinja environment with the same
    options, filters and globals, and the special tokens as variables. Encode the result without adding special
    tokens (the template writes them). ValueError naming a bad message, or `source` for a template that fails."""
    import jinja2
    if not isinstance(template, str) or len(template) > MAX_TEMPLATE_CHARS:
        raise ValueError(f"{source}: a template is a string of at most {MAX_TEMPLATE_CHARS} characters")
    check_messages(messages)
    budget = _steps_left.set([MAX_TEMPLATE_STEPS, MAX_TEMPLATE_ITEMS])
    try:
        pieces, size = [], 0
        for piece in _compiled(template).generate(messages=[dict(m) for m in messages], tools=None, documents=None,
                                                  add_generation_prompt=add_generation_prompt,
                                                  **(special_tokens or {})):
            size += len(piece)
            _check_size("the template's output", size)
            pieces.append(piece)
        return "".join(pieces)
    except jinja2.TemplateError as e:   # a syntax error, raise_exception(), an undefined name, the sandbox
        raise ValueError(f"{source} fails to render: {shown(str(e), 300)}") from None
    except Exception as e:    # anything else the template's own expressions raise (1 / 0, 'a' + 1, ...)
        raise ValueError(f"{source} fails to render: {type(e).__name__}: {shown(str(e), 300)}") from None
    finally:
        _steps_left.reset(budget)


_steps_left: contextvars.ContextVar[list[int]] = contextvars.ContextVar("tilekit_template_steps")


def _step() -> None:
    """Count one loop iteration or call of the render in progress; SecurityError past MAX_TEMPLATE_STEPS (a
    template that loops for hours: nested loops, a macro calling itself twice). The budget holds [steps left,
    items left] (items: _bounded)."""
    from jinja2.sandbox import SecurityError
    left = _steps_left.get()
    left[0] -= 1
    if left[0] < 0:
        raise SecurityError(f"the template makes more than {MAX_TEMPLATE_STEPS} loop iterations and calls")


def _counted(iterable):
    """A for loop's iterable, each item counted (_step)."""
    for item in iterable:
        _step()
        yield item


def _bounded(value):
    """`value` unless it is a string or collection of more than MAX_TEMPLATE_VALUE items, or its items bring those
    of all the values the render made past MAX_TEMPLATE_ITEMS (SecurityError)."""
    from jinja2.sandbox import SecurityError
    if isinstance(value, (str, bytes, list, tuple, dict)):
        if len(value) > MAX_TEMPLATE_VALUE:
            raise SecurityError(f"the template makes a value of {len(value)} items, more than {MAX_TEMPLATE_VALUE}")
        left = _steps_left.get()
        left[1] -= len(value)
        if left[1] < 0:
            raise SecurityError(f"the template makes more than {MAX_TEMPLATE_ITEMS} items in all")
    return value


def _check_size(what: str, size: int) -> None:
    """SecurityError when `what` would make more than MAX_TEMPLATE_VALUE items (checked before it is made)."""
    from jinja2.sandbox import SecurityError
    if size > MAX_TEMPLATE_VALUE:
        raise SecurityError(f"{what} would make {size} items, more than {MAX_TEMPLATE_VALUE}")


_WIDTHS = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\d*)(?:\.(\d*))?|\{[^{}]*?:([^{}]*)\}")


def _check_arguments(what: str, fmt, args, kwargs) -> None:
    """Before a call, filter or '%' runs: no integer argument past MAX_TEMPLATE_VALUE (a width, a count), no
    width or precision past it in a format string (`fmt`: '%99999999999s', '{:>99999999999}')."""
    from jinja2.sandbox import SecurityError
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_TEMPLATE_VALUE:
            raise SecurityError(f"{what} takes an integer past {MAX_TEMPLATE_VALUE}")
    if isinstance(fmt, str):
        for m in _WIDTHS.finditer(fmt):
            numbers = [g for g in m.groups()[:2] if g] + re.findall(r"\d+", m.group(3) or "")
            if any(len(n) > 9 or int(n) > MAX_TEMPLATE_VALUE for n in numbers):
                raise SecurityError(f"{what} has a width or precision past {MAX_TEMPLATE_VALUE}")


def _check_result_size(what: str, obj, args: tuple) -> tuple:
    """Before str.replace or str.join (method or filter) runs: the size of its result. Returns args, a join's
    iterable made a list (counted, then passed on)."""
    if what == "replace" and isinstance(obj, str) and len(args) >= 2 and isinstance(args[0], str) \
            and isinstance(args[1], str):
        count = obj.count(args[0]) if args[0] else len(obj) + 1
        _check_size("replace", len(obj) + count * max(0, len(args[1]) - len(args[0])))
    if what == "join" and isinstance(obj, str) and args and not isinstance(args[0], (str, Mapping)):
        items = list(_counted(args[0]))
        _check_size("join", len(obj) * max(0, len(items) - 1) + sum(len(str(x)) for x in items))
        args = (items, *args[1:])
    return args


def _check_deep_size(what: str, value, indent: int = 0) -> None:
    """SecurityError when `value`, walked through its nested strings and collections, holds more than
    MAX_TEMPLATE_VALUE items: what a filter rendering it whole (tojson, string, pprint, ...) would make; with
    `indent` (tojson's), each item's line indented by its depth counts too. The walk visits at most
    MAX_TEMPLATE_STEPS nodes (a list of the same list sixteen times, nested, is walked as a tree)."""
    from jinja2.sandbox import SecurityError
    size, stack, visits = 0, [(value, 0)], 0
    while stack:
        item, depth = stack.pop()
        visits += 1
        if visits > MAX_TEMPLATE_STEPS:
            raise SecurityError(f"{what} would render a value of more than {MAX_TEMPLATE_STEPS} nested items")
        size += 1 + depth * indent
        if isinstance(item, (str, bytes)):
            size += len(item)
        elif isinstance(item, Mapping):
            size += 2 + len(item)
            stack.extend((x, depth + 1) for pair in item.items() for x in pair)
        elif isinstance(item, (list, tuple, set, frozenset)):
            size += 2 + len(item)
            stack.extend((x, depth + 1) for x in item)
        else:
            size += 24                  # a number, None, a bool: at most a few dozen characters
        if size > MAX_TEMPLATE_VALUE:
            raise SecurityError(f"{what} would render a value of more than {MAX_TEMPLATE_VALUE} items")


def _check_spread(what: str, text, width, per: str) -> None:
    """Before indent / expandtabs: a width applied at each `per` of `text` (a line, a tab) must keep the result
    bounded."""
    width = len(width) if isinstance(width, str) else width         # indent also takes a string to prefix
    if isinstance(text, str) and isinstance(width, int) and not isinstance(width, bool):
        _check_size(what, len(text) + abs(width) * (text.count(per) + 1))


def _printed(value):
    """What '{{ ... }}' prints, unchanged: its whole text checked before it is made (the environment's finalize)."""
    if not isinstance(value, str):
        _check_deep_size("the template's output", value)
    return value


def _concat(pieces) -> str:
    """The '~' operator's join, bounded (the template's Concat nodes are rewritten to this filter)."""
    pieces = [str(_printed(p)) for p in pieces]
    _check_size("'~'", sum(map(len, pieces)))
    return _bounded("".join(pieces))


def _bounded_filter(name: str, f):
    """Filter `f` whose arguments (and the whole of the value it renders) are checked before it runs and whose
    result is bounded."""
    from jinja2.sandbox import SecurityError
    passed = hasattr(f, "jinja_pass_arg")         # a context, eval context or environment comes first

    @functools.wraps(f)
    def run(*args, **kwargs):
        lead, plain = (args[:1], args[1:]) if passed else ((), args)
        _check_arguments(f"the filter {name}", plain[0] if name == "format" and plain else None, plain[1:], kwargs)
        if name in RENDERING_FILTERS and plain:
            indent = kwargs.get("indent") if name == "tojson" else None
            indent = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
            _check_deep_size(f"the filter {name}", plain[0], abs(indent))
        if name == "indent" and plain:
            _check_spread("indent", plain[0], plain[1] if len(plain) > 1 else kwargs.get("width", 4), "\n")
        if name == "wordwrap" and plain and isinstance(plain[0], str) and len(plain[0]) > MAX_WRAPPED_CHARS:
            raise SecurityError(f"the filter wordwrap takes at most {MAX_WRAPPED_CHARS} characters")
        if name == "replace" and plain:
            _check_result_size("replace", plain[0], plain[1:])
        if name == "join" and plain:     # value|join(d): d.join(value), the iterable made a list on the way
            separator = plain[1] if len(plain) > 1 else kwargs.get("d", "")
            (items,) = _check_result_size("join", separator if isinstance(separator, str) else "", plain[:1])
            args = (*lead, items, *plain[1:])
        if name == "sum":                # sum(start=[]) concatenates lists in quadratic time
            start = plain[2] if len(plain) > 2 else kwargs.get("start", 0)
            if not isinstance(start, (int, float)):
                raise SecurityError("the filter sum adds numbers only (its start is not one)")
        result = f(*args, **kwargs)
        if isinstance(result, Iterator):     # batch, map, select, slice, ...: each item counted as it is made
            return _each_bounded(result)
        return _bounded(result)
    return run


def _each_bounded(items):
    """A filter's lazy result, each item counted as a step (_step) and bounded as a value (_bounded): nested
    lazy filters (batch of batch of ...) would otherwise build millions of small lists unseen."""
    for item in _counted(items):
        yield _bounded(item)


def check_messages(messages) -> None:
    """ValueError unless `messages` is a non-empty list of {"role": one of ROLES, "content": str}."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content', got {quoted(m, 100)}")
        if m["role"] not in ROLES:
            raise ValueError(f"messages[{i}] has an unknown role {quoted(m['role'], 100)}; "
                             f"roles are {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise ValueError(f"messages[{i}]['content'] must be a string, got {type(m['content']).__name__}")


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    """The template compiled in transformers' environment: sandboxed and immutable, trim_blocks and
    lstrip_blocks, loop controls, {% generation %} blocks (rendered as their body), a tojson that keeps
    non-ASCII and HTML characters, raise_exception() and strftime_now(). Bounded, unlike transformers': every
    loop iteration and call counts against MAX_TEMPLATE_STEPS, and no value it makes (by '*', '+', '%', '~', a
    call or a filter) nor its output may exceed MAX_TEMPLATE_VALUE items (bits for '**'): what could outgrow that
    in one step (widths, counts, replace, join) is checked before it runs."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def call(__self, __context, __obj, *args, **kwargs):   # noqa: N805 (jinja's signature)
            _step()
            name = getattr(__obj, "__name__", "")
            _check_arguments(f"the call {name}()", None, args, kwargs)    # format strings: wrap_str_format
            if name == "expandtabs":
                _check_spread("expandtabs", getattr(__obj, "__self__", None), args[0] if args else 8, "\t")
            args = _check_result_size(name, getattr(__obj, "__self__", None), args)
            return _bounded(super().call(__context, __obj, *args, **kwargs))

        def call_binop(self, context, operator, left, right):
            seq, times = (left, right) if isinstance(left, (str, list, tuple)) else (right, left)
            if operator == "*" and isinstance(seq, (str, list, tuple)) and isinstance(times, int) \
                    and len(seq) * times > MAX_TEMPLATE_VALUE:
                raise SecurityError(f"'*' would make {len(seq)} x {times} items, more than {MAX_TEMPLATE_VALUE}")
            if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 \
                    and right * abs(left).bit_length() > MAX_TEMPLATE_VALUE:
                raise SecurityError(f"'**' would make an integer of more than {MAX_TEMPLATE_VALUE} bits")
            if operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                _check_size("'+'", len(left) + len(right))
            if operator == "%" and isinstance(left, str):
                _check_arguments("'%'", left, right if isinstance(right, tuple) else (right,), {})
            return _bounded(super().call_binop(context, operator, left, right))

        def wrap_str_format(self, value):
            run = super().wrap_str_format(value)
            if run is None:
                return None

            def checked(*args, **kwargs):
                _check_arguments(f"the call {value.__name__}()", value.__self__, args, kwargs)
                return _bounded(run(*args, **kwargs))
            return checked

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, "jinja2.ext.loopcontrols"],
                  finalize=_printed)
    env.filters["tojson"] = tojson
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.filters["tilekit_counted"] = _counted    # filters: a template cannot rebind them
    env.filters["tilekit_concat"] = _concat
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        tree = env.parse(template)
    except jinja2.TemplateSyntaxError:
        return env.from_string(template)     # raises it again, as transformers reports it
    for loop in tree.find_all(jinja2.nodes.For):
        loop.iter = jinja2.nodes.Filter(loop.iter, "tilekit_counted", [], [], None, None).set_lineno(loop.lineno)
    for parent in list(tree.find_all(jinja2.nodes.Node)):      # '~' joins: bounded like '+'
        for name, child in parent.iter_fields():
            if isinstance(child, jinja2.nodes.Concat):
                setattr(parent, name, _concat_filter(jinja2, child))
            elif isinstance(child, list):
                setattr(parent, name, [_concat_filter(jinja2, c) if isinstance(c, jinja2.nodes.Concat) else c
                                       for c in child])
    return env.from_string(tree)


def _concat_filter(jinja2, node):
    """A Concat node as the tilekit_concat filter over the list of its parts."""
    return jinja2.nodes.Filter(jinja2.nodes.List(node.nodes), "tilekit_concat", [], [], None, None) \
        .set_lineno(node.lineno)
