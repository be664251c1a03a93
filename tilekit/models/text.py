"""Text around a model: a checkpoint's tokenizer and chat template, and incremental detokenization.

Every file read here comes from a stranger's checkpoint: it must be a regular file of bounded size that stays
inside the checkpoint directory (checkpoint_file), and a bad one is a ValueError naming it.
"""

from __future__ import annotations

import functools
import json
import os
import re
import stat
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Mapping, Sequence

from tilekit.models.hf import MAX_JSON_BYTES, read_json

MAX_TOKENIZER_BYTES = 64 << 20   # tokenizer.json of a 256k vocabulary is ~35 MB
MAX_TEMPLATE_CHARS = 1 << 20     # real chat templates are a few kB to a few tens of kB
ROLES = ("system", "user", "assistant", "tool")
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")    # a byte-fallback token (SentencePiece, Llama-2)
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def escape(text: str, limit: int = 120) -> str:
    """`text` safe to print in a message: non-printable characters escaped, cut to `limit` characters
    (callers pass repr(value) for a value)."""
    cut = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    return cut + ("..." if len(text) > limit else "")


# -- checkpoint files ------------------------------------------------------------------------------

def checkpoint_file(directory: str | Path, name: str, limit: int) -> Path | None:
    """The real path of file `name` in checkpoint `directory`, or None if there is no such entry.

    ValueError naming it unless it is a regular file (checked with stat, so a FIFO or device is never opened)
    of at most `limit` bytes that stays inside the directory once links resolve; a hub-cache snapshot's files
    link to ../../blobs, so for a snapshot the repository folder is the bound.
    """
    directory = Path(directory)
    path = directory / name
    if not os.path.lexists(path):
        return None
    root = directory.resolve()
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        root = root.parent.parent
    try:
        real = path.resolve(strict=True)
        st = real.stat()
    except (OSError, RuntimeError) as e:   # a dangling link; a link loop (RuntimeError before Python 3.13)
        raise ValueError(f"cannot read {path}: {escape(str(e))}") from None
    if not real.is_relative_to(root):
        raise ValueError(f"{path} leads outside the checkpoint directory (to {escape(str(real))})")
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path} is not a regular file")
    if st.st_size > limit:
        raise ValueError(f"{path} is larger than {limit} bytes")
    return real


def checkpoint_json(directory: str | Path, name: str) -> dict | None:
    """The JSON object in checkpoint file `name` (strict, bounded: read_json), or None if there is none."""
    path = checkpoint_file(directory, name, MAX_JSON_BYTES)
    return None if path is None else read_json(path)


def _checkpoint_text(directory: Path, name: str, limit: int) -> str | None:
    path = checkpoint_file(directory, name, limit)
    if path is None:
        return None
    try:
        return path.read_bytes().decode("utf-8")
    except OSError as e:
        raise ValueError(f"cannot read {directory / name}: {escape(str(e))}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{directory / name} is not UTF-8 text ({e.reason} at byte {e.start})") from None


# -- tokenizer -------------------------------------------------------------------------------------

def load_tokenizer(checkpoint_dir: str | Path):
    """The checkpoint's `tokenizers.Tokenizer`: tokenizer.json, or else vocab.json + merges.txt (GPT-2's
    byte-level BPE, with the special tokens tokenizer_config.json names registered as special)."""
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.decoders import ByteLevel as ByteLevelDecoder
    from tokenizers.models import BPE
    from tokenizers.pre_tokenizers import ByteLevel

    d = Path(checkpoint_dir)
    path = checkpoint_file(d, "tokenizer.json", MAX_TOKENIZER_BYTES)
    if path is not None:
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:   # tokenizers raises a bare Exception for a malformed file
            raise ValueError(f"cannot read tokenizer file {d / 'tokenizer.json'}: {escape(str(e), 300)}") from None
        tok.no_truncation()      # as transformers encodes by default: a file's truncation / padding unused
        tok.no_padding()
        return tok
    vocab = checkpoint_file(d, "vocab.json", MAX_JSON_BYTES)
    merges = checkpoint_file(d, "merges.txt", MAX_TOKENIZER_BYTES)
    if vocab is None or merges is None:
        raise FileNotFoundError(f"no tokenizer.json or vocab.json + merges.txt in {d}")
    try:
        tok = Tokenizer(BPE.from_file(str(vocab), str(merges)))
    except Exception as e:
        raise ValueError(f"cannot read tokenizer files {d / 'vocab.json'} and {d / 'merges.txt'}: "
                         f"{escape(str(e), 300)}") from None
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tok.decoder = ByteLevelDecoder()
    specials = [t for t in special_tokens(d).values() if tok.token_to_id(t) is not None]
    tok.add_special_tokens([AddedToken(t, special=True) for t in dict.fromkeys(specials)])
    return tok


def special_tokens(checkpoint_dir: str | Path) -> dict[str, str]:
    """bos_token, eos_token, ... of tokenizer_config.json (each a string or {"content": string}), as
    transformers hands them to a chat template; {} without the file."""
    name = "tokenizer_config.json"
    config = checkpoint_json(checkpoint_dir, name) or {}
    tokens = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if value is None:
            continue
        if not isinstance(value, str):
            raise ValueError(f"{Path(checkpoint_dir) / name}: {key} must be a string or an object with a string "
                             f"'content', got {escape(repr(config[key]))}")
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
    prompt: with its leading space.
    """

    def __init__(self, tokenizer, *, skip_special_tokens: bool = True, context: Sequence[int] = ()):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.hidden = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special and skip_special_tokens}
        self.ids = [int(i) for i in context]
        self.prefix, self.read = 0, len(self.ids)
        self.start = len(self._decode(0))   # the context's own text
        self.printed = ""

    def _decode(self, start: int, stop: int | None = None) -> str:
        return self.tokenizer.decode(self.ids[start:stop], skip_special_tokens=self.skip)

    def push(self, token_id: int) -> str:
        """The text that token_id completes ('' while it is held back)."""
        token_id = int(token_id)
        self.ids.append(token_id)
        if token_id in self.hidden or BYTE_TOKEN.fullmatch(self.tokenizer.id_to_token(token_id) or ""):
            return ""
        before, now = self._decode(self.prefix, self.read), self._decode(self.prefix)
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        piece = now[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        self.printed += piece
        return piece

    def flush(self) -> str:
        """The text not yet returned; after it the pieces add up to the whole decode (see the class doc)."""
        text = self._decode(0)[self.start:]
        if not text.startswith(self.printed):    # only a decoder unlike every kind above could do this
            raise RuntimeError("the streamed text is not a prefix of the decoded text")
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


def chat_template(checkpoint_dir: str | Path) -> ChatTemplate | None:
    """The checkpoint's chat template, found as transformers finds it: chat_template.jinja, else
    tokenizer_config.json's chat_template (a string, or a list of {"name", "template"} whose "default" is
    used); None if the checkpoint has none."""
    d = Path(checkpoint_dir)
    tokens = special_tokens(d)
    text = _checkpoint_text(d, "chat_template.jinja", MAX_TEMPLATE_CHARS)
    if text is not None:
        return ChatTemplate(text, str(d / "chat_template.jinja"), tokens)
    name = "tokenizer_config.json"
    value = (checkpoint_json(d, name) or {}).get("chat_template")
    where = f"{d / name}: chat_template"
    if value is None:
        return None
    if isinstance(value, list):
        if not all(isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
                   for t in value):
            raise ValueError(f"{where} must be a string or a list of {{'name': str, 'template': str}}")
        named = {t["name"]: t["template"] for t in value}
        if "default" not in named:
            raise ValueError(f"{where} names no 'default' template (it has {escape(repr(sorted(named)))})")
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
    try:
        return _compiled(template).render(messages=[dict(m) for m in messages], tools=None, documents=None,
                                          add_generation_prompt=add_generation_prompt, **(special_tokens or {}))
    except jinja2.TemplateError as e:   # a syntax error, raise_exception(), an undefined name, the sandbox
        raise ValueError(f"{source} fails to render: {escape(str(e), 300)}") from None
    except Exception as e:    # anything else the template's own expressions raise (1 / 0, 'a' + 1, ...)
        raise ValueError(f"{source} fails to render: {type(e).__name__}: {escape(str(e), 300)}") from None


def check_messages(messages) -> None:
    """ValueError unless `messages` is a non-empty list of {"role": one of ROLES, "content": str}."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content', got {escape(repr(m))}")
        if m["role"] not in ROLES:
            raise ValueError(f"messages[{i}] has an unknown role {escape(repr(m['role']))}; "
                             f"roles are {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise ValueError(f"messages[{i}]['content'] must be a string, got {type(m['content']).__name__}")


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    """The template compiled in transformers' environment: sandboxed and immutable, trim_blocks and
    lstrip_blocks, loop controls, {% generation %} blocks (rendered as their body), a tojson that keeps
    non-ASCII and HTML characters, raise_exception() and strftime_now()."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

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

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
