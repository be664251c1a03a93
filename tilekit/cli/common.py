"""What the subcommands share: misuse as one line (UsageError, the parser), argument types, the model workload
options, progress lines, and reading a text file a user names."""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

DTYPE_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
                 "fp32": "float32", "float32": "float32"}


class UsageError(Exception):
    """Misuse of a command: one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with misuse reported as one `tilekit: ...` line (exit 2), like UsageError, and no
    abbreviated options (a `tune --dev all` would otherwise reach its workers as --devices)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"tilekit: {self.prog.removeprefix('tilekit ')}: {message} (see `{self.prog} --help`)\n"
                  if self.prog != "tilekit" else f"tilekit: {message} (see `tilekit --help`)\n")


# -- small helpers ---------------------------------------------------------------------------

MAX_BATCH, MAX_TOKENS = 4096, 1 << 20      # a workload's batch size and its prompt or generated tokens


def _int_list(text: str, most: int) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()] if len(text) <= 1000 else None
    except ValueError:
        values = None
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text[:100]!r}")
    if min(values) < 1 or max(values) > most:
        raise argparse.ArgumentTypeError(f"expected integers in [1, {most}], got {text!r}")
    return values


def _batch_sizes(text: str) -> list[int]:
    return _int_list(text, MAX_BATCH)


def _token_counts(text: str) -> list[int]:
    return _int_list(text, MAX_TOKENS)


def _token_count(text: str) -> int:
    values = _int_list(text, MAX_TOKENS)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one integer in [1, {MAX_TOKENS}], got {text!r}")
    return values[0]


def _dtype(text: str) -> str:
    try:
        return DTYPE_ALIASES[text.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"dtype must be one of {', '.join(DTYPE_ALIASES)}") from None


def _config_for(model: str):
    """A preset name (of any family) or a checkpoint / config.json -> the config of its family."""
    from tilekit.models import families
    if model in families.preset_names():
        return families.preset_config(model)
    try:
        return families.config_from_path(model)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(f"--model {model!r} is neither a preset ({', '.join(families.preset_names())}) nor a "
                         f"usable checkpoint or config.json: {e}")


def _parse_shape(op, text: str, dtype: str) -> dict:
    problem, given = dict(op.field_defaults, dtype=dtype), set()
    if len(text) > 1000:
        raise UsageError(f"--shape is {len(text)} characters long; a problem takes a few dozen")
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep:
            raise UsageError(f"--shape items look like NAME=VALUE, got {_shown(item, 100)}")
        if name in given:
            raise UsageError(f"--shape names {_shown(name, 100)} twice")
        given.add(name)
        problem[name] = int(value) if re.fullmatch(r"-?[0-9]+", value) else value     # ASCII digits only (not '²')
    unknown = set(problem) - set(op.fields)
    missing = [f for f in op.fields if f not in problem]
    if unknown or missing:
        raise UsageError(f"--shape for {op.name} takes {', '.join(op.fields)}"
                         + (f"; unknown: {', '.join(sorted(unknown))}" if unknown else "")
                         + (f"; missing: {', '.join(missing)}" if missing else ""))
    errors = op.problem_errors(problem)
    if errors:
        raise UsageError(f"--shape for {op.name}: {_shown('; '.join(errors), 400)}")
    return {f: problem[f] for f in op.fields}


class Progress:
    """One status line on a terminal (rewritten in place), plain lines otherwise."""

    def __init__(self, stream=sys.stderr):
        self.stream = stream
        self.tty = stream.isatty()
        self.last = 0.0

    def line(self, text: str, *, force: bool = False) -> None:
        now = time.monotonic()
        if self.tty:
            self.stream.write("\r\033[K" + text[:120])
            self.stream.flush()
        elif force or now - self.last > 5:
            self.stream.write(text + "\n")
            self.stream.flush()
            self.last = now

    def done(self) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
            self.stream.flush()


def _shown(text: str, limit: int = 160) -> str:
    """Text read from a file as one short printable line."""
    if text.isprintable() and len(text) <= limit:
        return text
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = int(width * done / max(total, 1))
    return "[" + "#" * filled + "." * (width - filled) + f"] {done}/{total}"


def _check_quantize_head(args) -> None:
    if args.quantize_head and args.quantize is None:
        raise UsageError("--quantize-head goes with --quantize int8 | fp8")


def _model_problems(args) -> list:
    """The workload of --model with its --dtype, sizes, --quantize[-head] and --tp (tune, db explain); a quantized
    checkpoint's own scheme (FP8 block scales, its LM head as stored)."""
    from tilekit.models import families
    from tilekit.engine.workload import model_problems
    config = _config_for(args.model)
    if args.model in families.preset_names():
        quantize, head = args.quantize, args.quantize_head
    else:
        quantize, head = families.quantization_of(args.model, args.quantize, args.quantize_head), False
    return model_problems(config, args.dtype, args.batch_sizes, args.seq_lens, args.new_tokens, quantize, args.tp,
                          head)


def _read_text(name: str, what: str, limit: int) -> str:
    """The UTF-8 text of a regular file of at most `limit` bytes (a FIFO or device is refused unopened)."""
    import stat
    try:
        st = os.stat(name)
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"{what} {_shown(name)} is not a regular file")
        if st.st_size > limit:
            raise UsageError(f"{what} {_shown(name)} is larger than {limit} bytes")
        with open(name, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise UsageError(f"cannot read {what} {_shown(name)}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{what} {_shown(name)} is not UTF-8 text (byte {e.start})") from None


def _arch(text: str) -> str:
    from tilekit.autotune.db import ARCH
    if not ARCH.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected sm_<digits> such as sm_90, got {text!r}")
    return text


def _model_args(p, default_model=None):
    p.add_argument("--model", default=default_model,
                   help="a preset (gpt2, gpt2-medium, gpt2-large, gpt2-xl, llama-3.2-1b, ...), or a checkpoint "
                        "directory / config.json / HF cache name")
    p.add_argument("--batch-sizes", type=_batch_sizes, default=[1, 8],
                   help=f"comma-separated, each at most {MAX_BATCH} (default 1,8)")
    p.add_argument("--seq-lens", type=_token_counts, default=[128, 1024],
                   help=f"comma-separated, each at most {MAX_TOKENS} (default 128,1024)")
    p.add_argument("--dtype", type=_dtype, default="bfloat16", help="bf16 (default), fp16 or fp32")
    p.add_argument("--new-tokens", type=_token_count, default=128,
                   help=f"tokens generate() adds after each prompt in the workload (default 128, at most {MAX_TOKENS})")
    p.add_argument("--quantize", choices=("int8", "fp8"),
                   help="the workload of the model with its linears quantized (Llama and DeepSeek-V2 families)")
    p.add_argument("--quantize-head", action="store_true",
                   help="with --quantize: its untied LM head too (Llama and DeepSeek-V2 families)")
    p.add_argument("--tp", type=_positive, default=1,
                   help="the workload of each rank of the model split over this many GPUs (tensor parallelism; "
                        "Llama, GPT-2 and DeepSeek-V2 families)")


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _positive(text: str) -> int:
    value = _count(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _minutes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of minutes, got {text!r}")
    return value


def _version() -> str:
    import tilekit
    return f"tilekit {tilekit.__version__}"
