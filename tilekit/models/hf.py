"""Hugging Face model files, for every family: find a checkpoint (a directory or the local hub cache), open its
files safely, read config.json field by field, check safetensors headers against the tensors a model expects,
stream the tensors to the GPU in the model's dtype, and write checkpoints. A family describes its tensors with a
CheckpointLayout and reads its config with Fields; its tokenizer and generation config are read through the same
Checkpoint (tilekit.models.text, tilekit.models.generation).

Every file is untrusted. Reads stay inside the checkpoint directory (in a hub snapshot, also the repository's
blobs), open regular files only and are bounded; a bad file is a FileNotFoundError or a ModelFileError (a
ValueError) naming the file and the field, raised before any large allocation; names and values from files are
escaped in messages. Nothing here names a model family, and CuPy is imported only when a GPU load starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import math
import os
import re
import stat
import sys
import tempfile
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from tilekit.autotune.arrays import numpy_dtype
from tilekit.env import expand_user, hub_cache_dir
from tilekit.parallel.splits import part_fields, part_problem, part_shape, take_part
from tilekit.untrusted import parse_json, quoted, shown

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
MAX_JSON_BYTES = 32 << 20   # a config.json, shard index or safetensors header; larger ones are refused unread
MAX_RANK = 8
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?", re.ASCII)
_REVISION = re.compile(r"[0-9a-f]{4,64}")   # a snapshot's name: a commit hash
_SHARD = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")

# safetensors dtype -> (bytes per element, the NumPy dtype a tensor is viewed as; FP8 as its uint8 bit patterns)
DTYPES = {"BOOL": (1, "bool"), "U8": (1, "uint8"), "I8": (1, "int8"), "F8_E4M3": (1, "uint8"),
          "F8_E5M2": (1, "uint8"), "I16": (2, "int16"), "U16": (2, "uint16"), "F16": (2, "float16"),
          "BF16": (2, "bfloat16"), "I32": (4, "int32"), "U32": (4, "uint32"), "F32": (4, "float32"),
          "I64": (8, "int64"), "U64": (8, "uint64"), "F64": (8, "float64")}
FLOATS = ("BF16", "F16", "F32")                                  # what a Target accepts by default
TARGET_DTYPES = ("bfloat16", "float16", "float32", "float64")
# float dtype -> (the unsigned integer of its width, its exponent bits): all of them set is an infinity or a NaN
# (FP8 e4m3, which has no infinity: exponent and mantissa bits all set, its NaN codes 0x7F and 0xFF)
EXPONENT_BITS = {"bfloat16": ("uint16", 0x7F80), "float16": ("uint16", 0x7C00), "float32": ("uint32", 0x7F800000),
                 "float64": ("uint64", 0x7FF0000000000000), "float8_e4m3fn": ("uint8", 0x7F)}
FLOAT_BITS = {"F8_E4M3": "float8_e4m3fn"}     # a safetensors dtype DTYPES views as uint8 -> the float it holds
_WRITE_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


# -- messages -----------------------------------------------------------------------------------------------

def json_shown(value) -> str:
    """A JSON value from a file as JSON text (escaped), cut after 100 characters."""
    text = json.dumps(value, ensure_ascii=True)
    return text if len(text) <= 100 else text[:100] + "..."


class ModelFileError(ValueError):
    """A model file tilekit refuses; the message is the file, then the field and the problem."""

    def __init__(self, path, problem: str):
        super().__init__(f"{shown(path)}: {problem}")
        self.path, self.problem = path, problem

    def __reduce__(self):
        return type(self), (self.path, self.problem)


# -- files --------------------------------------------------------------------------------------------------

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class TensorValueError(ValueError):
    """Raised by a load transform for values its tensor must not hold (the loader names the file and tensor)."""


class RegularFile:
    """An open regular file: checked with stat before opening (a FIFO or device is never opened) and with fstat
    after; reads are positional and exact. `path` is how messages name it, `real` where it resolves to."""

    def __init__(self, path, real: str | None = None):
        self.path = path
        real = os.path.realpath(path) if real is None else real
        try:
            st = os.stat(real)
            if not stat.S_ISREG(st.st_mode):
                kind = next((k for test, k in _KINDS if test(st.st_mode)), "a special file")
                raise ModelFileError(path, f"is not a regular file but {kind}")
            self.fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise _os_error(path, real, e) from None
        now = os.fstat(self.fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            self.close()
            raise ModelFileError(path, "changed while it was being opened")
        self.size, self.id = now.st_size, (now.st_dev, now.st_ino)

    def readinto(self, view: memoryview, offset: int) -> None:
        """Fill `view` from byte `offset`; ModelFileError if the file ends first (it shrank) or a read fails."""
        done = 0
        try:
            while done < len(view):
                got = os.preadv(self.fd, [view[done:]], offset + done)
                if got == 0:
                    raise ModelFileError(self.path, f"ends at byte {offset + done}, before byte {offset + len(view)}"
                                                    " (it shrank after its header was read)")
                done += got
        except OSError as e:
            raise ModelFileError(self.path, f"cannot be read ({e.strerror})") from None

    def read(self, n: int, offset: int = 0) -> bytearray:
        buf = bytearray(n)
        self.readinto(memoryview(buf), offset)
        return buf

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "RegularFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _os_error(path, real: str, e: OSError) -> Exception:
    """An OSError met opening `path` as the error to raise, naming the file."""
    if isinstance(e, FileNotFoundError):
        if os.path.lexists(path):
            return FileNotFoundError(f"{shown(path)}: is a broken link (to {shown(real)}, which does not exist)")
        return FileNotFoundError(f"{shown(path)}: no such file")
    return ModelFileError(path, f"cannot be opened ({e.strerror})")


def _whole(file: RegularFile, limit: int) -> bytearray:
    """An open file's bytes, read whole; ModelFileError, unread, if it is larger than `limit`."""
    if file.size > limit:
        raise ModelFileError(file.path, "is larger than " + (f"{limit >> 20} MiB" if limit % (1 << 20) == 0
                                                              else f"{limit} bytes"))
    return file.read(file.size)


def _json_object(file: RegularFile) -> dict:
    """The JSON object in an open file, read whole (at most MAX_JSON_BYTES)."""
    try:
        d = parse_json(_whole(file, MAX_JSON_BYTES))
    except ModelFileError:
        raise
    except ValueError as e:
        raise ModelFileError(file.path, str(e)) from None
    if not isinstance(d, dict):
        raise ModelFileError(file.path, f"holds {json_shown(d)}, expected a JSON object")
    return d


def read_json(path) -> dict:
    """The JSON object in the file `path` (any location: for files a user names; a checkpoint's files are read
    with Checkpoint.read_json)."""
    with RegularFile(path) as f:
        return _json_object(f)


# -- checkpoints --------------------------------------------------------------------------------------------

def _inside(real: str, root: str) -> bool:
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def plain_name_problem(name) -> str | None:
    """Why `name` is not a plain file name (no directories, no control characters, at most 255 bytes), or None."""
    if not isinstance(name, str):
        return "is not a string"
    if name in ("", ".", "..") or "/" in name or "\\" in name:
        return "is not a plain file name"
    if not name.isprintable():
        return "has control characters"
    if len(os.fsencode(name)) > 255:
        return "is longer than 255 bytes"
    return None


def _snapshot_roots(real_dir: str) -> tuple[str, ...]:
    """Where the files of directory `real_dir` may resolve to: itself, and for a hub snapshot
    (models--*/snapshots/<rev>) its repository's blobs, where huggingface_hub links them."""
    snapshots, repo = os.path.dirname(real_dir), os.path.dirname(os.path.dirname(real_dir))
    if os.path.basename(snapshots) == "snapshots" and os.path.basename(repo).startswith("models--"):
        return real_dir, os.path.join(repo, "blobs")
    return (real_dir,)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint directory whose files are opened by plain name, only when they are regular files resolving
    inside `roots` (the directory; for a hub snapshot also its repository's blobs)."""

    directory: Path
    roots: tuple[str, ...]

    @classmethod
    def at(cls, directory) -> "Checkpoint":
        """The checkpoint in `directory` (a Checkpoint is returned as it is)."""
        if isinstance(directory, Checkpoint):
            return directory
        directory = Path(os.path.abspath(directory))
        return cls(directory, _snapshot_roots(os.path.realpath(directory)))

    def has(self, name: str) -> bool:
        """Whether the directory has an entry `name` (a broken link counts: opening it says what is wrong)."""
        return os.path.lexists(self.directory / name)

    def open(self, name: str) -> RegularFile:
        problem = plain_name_problem(name)
        if problem:
            raise ValueError(f"file name {quoted(str(name))} {problem}")
        path = self.directory / name
        real = os.path.realpath(path)
        if not any(_inside(real, root) for root in self.roots):
            raise ModelFileError(path, f"resolves to {shown(real)}, outside {' and '.join(map(shown, self.roots))}")
        return RegularFile(path, real)

    def read_json(self, name: str) -> dict:
        with self.open(name) as f:
            return _json_object(f)

    def read_text(self, name: str, limit: int) -> str:
        """The UTF-8 text of file `name`, at most `limit` bytes."""
        with self.open(name) as f:
            raw = _whole(f, limit)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ModelFileError(f.path, f"is not UTF-8 text ({e.reason} at byte {e.start})") from None

    def config(self) -> "Fields":
        """config.json, for typed reads of its fields."""
        return Fields(self.read_json(CONFIG_NAME), self.directory / CONFIG_NAME)

    def tensor_files(self) -> "TensorFiles":
        return TensorFiles(self)

    def check(self) -> None:
        """FileNotFoundError or ModelFileError unless config.json and the weights (model.safetensors, else the
        shard index) are regular files in the checkpoint."""
        self.open(CONFIG_NAME).close()
        name = WEIGHTS_NAME if self.has(WEIGHTS_NAME) or not self.has(INDEX_NAME) else INDEX_NAME
        if not self.has(name):
            raise FileNotFoundError(f"{shown(self.directory)}: lacks {WEIGHTS_NAME} or {INDEX_NAME}")
        self.open(name).close()


def read_config(path) -> "Fields":
    """The fields of a config.json file a user names (outside any checkpoint)."""
    path = expand_user(os.fspath(path), "config path")
    return Fields(read_json(path), path)


def find_checkpoint(path_or_name, orgs: tuple[str, ...] = ()) -> Checkpoint:
    """The checkpoint at `path_or_name`: a directory, else a hub model name in the local Hugging Face cache (a
    bare name also as org/name for each of `orgs`). It must hold config.json and model.safetensors or
    model.safetensors.index.json. Never touches the network. A Checkpoint is returned as it is."""
    if isinstance(path_or_name, Checkpoint):
        return path_or_name
    if not isinstance(path_or_name, (str, os.PathLike)) or not isinstance(os.fspath(path_or_name), str):
        raise TypeError(f"checkpoint must be a path or a model name, got {type(path_or_name).__name__}")
    text = os.fspath(path_or_name)
    if "\0" in text:
        raise ValueError(f"checkpoint path {quoted(text)} contains a NUL character")
    path = expand_user(text, "checkpoint path")
    try:
        is_dir = stat.S_ISDIR(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        is_dir = None
    except OSError as e:
        if e.errno == errno.ENAMETOOLONG:
            raise ValueError(f"checkpoint path {quoted(text)} ({len(text)} characters) is too long") from None
        raise ModelFileError(path, f"cannot be opened ({e.strerror})") from None
    if is_dir:
        checkpoint = Checkpoint.at(path)
        checkpoint.check()
        return checkpoint
    if is_dir is False:
        raise FileNotFoundError(f"{shown(path)}: is not a checkpoint directory")
    searched = [shown(os.path.abspath(path))]
    if _HUB_NAME.fullmatch(text):
        cache, var = hub_cache_dir()
        for repo_id in [text] + ([f"{org}/{text}" for org in orgs] if "/" not in text else []):
            found, tried = _cached_snapshot(cache / ("models--" + repo_id.replace("/", "--")))
            if found:
                return found
            searched += tried
        if not os.path.isdir(cache):
            searched.append(f"{shown(cache)}: no such directory (the hub cache, from {var})")
    raise FileNotFoundError(f"no checkpoint {quoted(text)}; searched: " + "; ".join(searched))


def _cached_snapshot(repo: Path) -> tuple[Checkpoint | None, list[str]]:
    """The snapshot of hub-cache repository `repo` that is a complete checkpoint, refs/main's revision first,
    then the newest; else None and, for each place searched, why it was not used."""
    snapshots = repo / "snapshots"
    try:
        entries = sorted(os.scandir(snapshots), key=lambda e: e.stat(follow_symlinks=False).st_mtime, reverse=True)
    except OSError:
        return None, [shown(snapshots)]
    revisions = [e.name for e in entries if _REVISION.fullmatch(e.name)]
    refs = Checkpoint(repo / "refs", (os.path.realpath(repo),))
    if refs.has("main"):
        with refs.open("main") as f:
            if f.size > 256:
                raise ModelFileError(f.path, f"is {f.size} bytes, too large for a revision")
            text = f.read(f.size).decode("utf-8", "replace").strip()
        if not _REVISION.fullmatch(text):
            raise ModelFileError(f.path, f"names revision {quoted(text)}, which is not a commit hash")
        revisions = [text] + [r for r in revisions if r != text]
    tried, within = [], os.path.realpath(snapshots)
    for revision in revisions:
        directory = snapshots / revision
        real = os.path.realpath(directory)
        try:
            if os.path.dirname(real) != within:
                raise ModelFileError(directory, f"resolves to {shown(real)}, outside {shown(snapshots)}")
            if not os.path.isdir(real):
                raise FileNotFoundError(f"{shown(directory)}: no such directory")
            checkpoint = Checkpoint.at(directory)
            checkpoint.check()
            return checkpoint, tried
        except (FileNotFoundError, ModelFileError) as e:
            tried.append(str(e))
    return None, tried or [f"{shown(snapshots)}: no snapshot"]


# -- config.json fields -------------------------------------------------------------------------------------

REQUIRED = object()


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finite(v) -> bool:
    try:
        return (_is_int(v) or isinstance(v, float)) and math.isfinite(float(v))
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
        return self._get(key, default, "an integer" + _bounds(low, high), lambda v: _is_int(v) and (
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
            return _is_int(v) and 0 <= v and (vocab is None or v < vocab)
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


# -- config arguments ---------------------------------------------------------------------------------------

MAX_SIZE = 1 << 24         # no model dimension comes near; a config claiming more is refused
MAX_LAYERS = 4096


def check_positive_ints(config, names) -> None:
    """ValueError naming the first of `names` whose value in `config` is not a positive int (bools are not) of
    plausible size (a hostile config must not make the shape checks run for hours)."""
    for name in names:
        value = getattr(config, name)
        if not _is_int(value) or value <= 0:
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
    if not eos or not all(t is None or (_is_int(t) and 0 <= t < config.vocab_size)
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


def float_dtype(dtype) -> np.dtype:
    """`dtype` as a NumPy dtype, which must be float32 or float64: what host copies of checkpoints load as."""
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise ValueError(f"dtype must be float32 or float64, got {dtype}")
    return dtype


# -- safetensors headers ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorInfo:
    """One tensor as its safetensors header declares it; start and end are byte offsets in `file`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: RegularFile
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(file: RegularFile) -> dict[str, TensorInfo]:
    """The tensors of an open safetensors file, every header entry checked against the file (a known dtype, a
    shape of non-negative integers, data_offsets that tile the data exactly, as the safetensors library requires)
    before any tensor data is read."""
    def bad(problem: str) -> ModelFileError:
        return ModelFileError(file.path, problem)
    if file.size < 8:
        raise bad(f"is {file.size} bytes, too short for a safetensors file")
    n = int.from_bytes(file.read(8), "little")
    if n > MAX_JSON_BYTES:
        raise bad(f"declares a {n}-byte header, larger than {MAX_JSON_BYTES >> 20} MiB")
    if 8 + n > file.size:
        raise bad(f"declares a {n}-byte header but is {file.size} bytes")
    try:
        header = parse_json(file.read(n, 8))
    except ValueError as e:
        raise bad(f"header is {e}") from None
    if not isinstance(header, dict):
        raise bad(f"header is {json_shown(header)}, expected a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise bad(f"header field '__metadata__' is {json_shown(metadata)}, expected an object of strings")
    data, size = 8 + n, file.size - 8 - n
    tensors = {}
    for name, entry in header.items():
        def wrong(field: str, expected: str) -> ModelFileError:
            return bad(f"tensor {quoted(name)}: {field} is {json_shown(entry.get(field))}, expected {expected}")
        if not isinstance(entry, dict) or entry.keys() != {"dtype", "shape", "data_offsets"}:
            raise bad(f"tensor {quoted(name)} is {json_shown(entry)}, expected an object with exactly dtype, shape "
                      "and data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise wrong("dtype", "one of " + ", ".join(sorted(DTYPES)))
        if not isinstance(shape, list) or len(shape) > MAX_RANK or not all(_is_int(d) and d >= 0 for d in shape):
            raise wrong("shape", f"a list of at most {MAX_RANK} non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets))
                and 0 <= offsets[0] <= offsets[1] <= size):
            raise wrong("data_offsets", f"[begin, end] with 0 <= begin <= end <= {size}, the size of the data")
        nbytes = math.prod(shape) * DTYPES[dtype][0]
        if offsets[1] - offsets[0] != nbytes:
            raise bad(f"tensor {quoted(name)}: data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, but "
                      f"{dtype} {tuple(shape)} takes {nbytes}")
        tensors[name] = TensorInfo(name, dtype, tuple(shape), file, data + offsets[0], data + offsets[1])
    end = data
    for t in sorted(tensors.values(), key=lambda t: (t.start, t.end)):
        if t.start != end:
            where = "overlaps the tensor before it" if t.start < end else f"leaves bytes [{end - data}, " \
                    f"{t.start - data}) of the data unused"
            raise bad(f"tensor {quoted(t.name)}: data_offsets [{t.start - data}, {t.end - data}] {where}")
        end = t.end
    if end != file.size:
        raise bad(f"tensors end at byte {end - data} of the data, but the file holds {size} bytes of data")
    return tensors


class TensorFiles:
    """A checkpoint's safetensors files, open, and every tensor their headers declare (checked; no data read):
    model.safetensors if present (as in transformers), else the shards model.safetensors.index.json names. Each
    shard must be a plain file name, no file may be named twice, and each shard must hold exactly the tensors the
    index maps to it. `source` is the file messages name: model.safetensors or the index."""

    def __init__(self, checkpoint: Checkpoint):
        self.files: list[RegularFile] = []
        self.tensors: dict[str, TensorInfo] = {}
        try:
            if checkpoint.has(WEIGHTS_NAME) or not checkpoint.has(INDEX_NAME):
                self.source = checkpoint.directory / WEIGHTS_NAME
                self.files.append(checkpoint.open(WEIGHTS_NAME))
                self.tensors = read_header(self.files[0])
                return
            self.source = checkpoint.directory / INDEX_NAME
            shards: dict[str, set[str]] = {}
            for name, shard in self._weight_map(checkpoint).items():
                shards.setdefault(shard, set()).add(name)
            seen = {}
            for shard in sorted(shards):
                self.files.append(checkpoint.open(shard))
                first = seen.setdefault(self.files[-1].id, shard)
                if first != shard:
                    raise ModelFileError(self.source, f"names one file twice: {quoted(first)} and {quoted(shard)}")
            for f, names in zip(self.files, (shards[s] for s in sorted(shards))):
                header = read_header(f)
                problems = [f"{what} {', '.join(map(quoted, sorted(found)[:5]))}"
                            + (f" and {len(found) - 5} more" if len(found) > 5 else "")
                            for what, found in (("holds tensors the index maps elsewhere or not at all",
                                                 header.keys() - names),
                                                ("lacks tensors the index maps to it", names - header.keys()))
                            if found]
                if problems:
                    raise ModelFileError(f.path, f"does not match {INDEX_NAME}: it " + "; it ".join(problems))
                self.tensors.update(header)
        except BaseException:
            self.close()
            raise

    def _weight_map(self, checkpoint: Checkpoint) -> dict[str, str]:
        index = Fields(checkpoint.read_json(INDEX_NAME), self.source)
        weight_map = index.object("weight_map").d
        if not weight_map:
            raise index.error("weight_map", "is {}, expected a map of tensor names to shard files")
        for name, shard in weight_map.items():
            problem = plain_name_problem(shard)
            if problem:
                raise index.error("weight_map", f"maps {quoted(name)} to {json_shown(shard)}, which {problem}")
        return weight_map

    def close(self) -> None:
        for f in self.files:
            f.close()

    def __enter__(self) -> "TensorFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- load plans ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes. `shape`: its shape in the file. `out`: the array to write (a view of a
    larger one is fine, e.g. rows of a fused weight), a function returning one (called when the tensor is
    reached), or None for a new `dtype` array of `shape`. `transform(src, out)`, on the device, instead of
    convert(src, out): src is the file's tensor as a device array (FP8 as uint8 bits), valid only during the
    call. `accept`: the safetensors dtypes allowed. `optional`: the file may lack it. `part`: (axis, start, stop)
    or (axis, start, stop, groups), only that slice of the file's tensor is loaded (a tensor-parallel shard; `out`
    has the slice's shape; with groups g the axis is g equal blocks, e.g. a fused [q, k, v], and start:stop is
    taken from each): rows (axis 0, one group) are read alone, being contiguous in the file; another slice reads
    the tensor and keeps the slice in the device conversion (only the slice is allocated)."""

    shape: tuple[int, ...]
    dtype: str = "bfloat16"
    out: object = None
    transform: Callable | None = None
    accept: tuple[str, ...] = FLOATS
    optional: bool = False
    part: tuple[int, ...] | None = None

    @property
    def out_shape(self) -> tuple[int, ...]:
        """The shape of what is written: `shape`, or its `part`."""
        return tuple(self.shape) if self.part is None else part_shape(self.shape, self.part)


def _narrowed(info: TensorInfo, target: Target) -> tuple[TensorInfo, Target]:
    """A job of a sliced target as one of a whole one: rows as a shorter tensor of the file; another slice as the
    whole tensor whose transform (or conversion) takes the slice."""
    if target.part is None:
        return info, target
    axis, start, stop, groups = part_fields(target.part)
    if axis == 0 and groups == 1:
        row = info.nbytes // info.shape[0] if info.shape[0] else 0
        shape = (stop - start,) + info.shape[1:]
        return (TensorInfo(info.name, info.dtype, shape, info.file, info.start + start * row, info.start + stop * row),
                dataclasses.replace(target, shape=shape, part=None))
    inner, part = target.transform or convert, target.part
    return info, dataclasses.replace(target, shape=target.out_shape, part=None,
                                     transform=lambda src, out: inner(take_part(src, part), out))


def convert(src, out) -> None:
    """out[...] = src in out's dtype (NumPy or CuPy; CuPy 14 casts bfloat16), out possibly strided. (What overflows
    is refused after the load: _Stream.check_finite.)"""
    with np.errstate(over="ignore"):
        out[...] = src


def tensor_problems(found: Mapping[str, tuple[str, tuple[int, ...]]], plan: Mapping[str, Target],
                    ignore: tuple[str, ...] = ()) -> list[str]:
    """Every unexpected (not ending in one of `ignore`), wrongly typed, misshapen and missing tensor of `found`
    (name -> (safetensors dtype, shape)) against `plan`; missing ones last, so a wrong prefix shows first."""
    problems = []
    for name, (dtype, shape) in found.items():
        target = plan.get(name)
        if target is None:
            if not name.endswith(ignore):
                problems.append(f"unexpected tensor {quoted(name)}")
        elif dtype not in target.accept:
            problems.append(f"tensor {quoted(name)} has dtype {dtype}, expected {' or '.join(target.accept)}")
        elif shape != tuple(target.shape):
            problems.append(f"tensor {quoted(name)} has shape {shape}, expected {tuple(target.shape)}")
    return problems + [f"missing tensor {quoted(name)} (shape {tuple(t.shape)})" for name, t in plan.items()
                       if name not in found and not t.optional]


def listing(heading: str, problems: list[str], most: int = 10) -> str:
    """`heading`, then up to `most` problems, one per indented line."""
    more = f"\n  ... and {len(problems) - most} more" if len(problems) > most else ""
    return heading + ":\n  " + "\n  ".join(problems[:most]) + more


def _check_target(name: str, t: Target, out=None) -> None:
    """ValueError for a plan entry that cannot work (a caller's mistake, not the file's); `out`: the array its
    allocator made."""
    if t.dtype not in TARGET_DTYPES:
        raise ValueError(f"plan for {quoted(name)}: dtype must be one of {TARGET_DTYPES}, got {t.dtype!r}")
    if t.transform is None and any(d.startswith("F8") for d in t.accept):
        raise ValueError(f"plan for {quoted(name)}: accepting FP8 needs a transform (FP8 arrives as uint8 bits)")
    problem = t.part is not None and part_problem(tuple(t.shape), tuple(t.part))
    if problem:
        raise ValueError(f"plan for {quoted(name)}: part {t.part} is {problem}")
    out = t.out if out is None else out
    if out is not None and not callable(out) and t.transform is None and (
            tuple(out.shape) != t.out_shape or str(out.dtype) != t.dtype):
        raise ValueError(f"plan for {quoted(name)}: out is {out.dtype} {tuple(out.shape)}, expected {t.dtype} "
                         f"{t.out_shape}")


def load_tensors(files: TensorFiles, plan: Mapping[str, Target], *, device=None, ignore: tuple[str, ...] = (),
                 expected: str = "the model", buffers: int = 4, buffer_bytes: int = 64 << 20,
                 progress: bool = True) -> dict:
    """Every tensor of `plan` from `files` into its target; returns name -> the array written.

    First the headers are checked against the plan (one ModelFileError listing every unexpected, wrongly typed,
    misshapen and missing tensor; names ending in one of `ignore` are skipped). Then tensors stream in file
    order through `buffers` staging buffers of at most `buffer_bytes` (a larger tensor goes in pieces): worker
    threads read the next pieces while the device copies earlier ones, and each tensor is converted on the
    device into its target. Host memory: the staging buffers. `device`: CupyDevice() (the current GPU) by
    default, HostDevice() for NumPy arrays. A progress bar goes to stderr (a TTY) for loads over two seconds.
    """
    device = device or CupyDevice()
    for name, target in plan.items():
        _check_target(name, target)
        if target.dtype not in device.dtypes:
            raise ValueError(f"plan for {quoted(name)}: {target.dtype} is not a dtype of this device ({device.dtypes})")
    problems = tensor_problems({n: (t.dtype, t.shape) for n, t in files.tensors.items()}, plan, ignore)
    if problems:
        raise ModelFileError(files.source, listing(f"does not match {expected}", problems))
    if buffers < 1 or buffer_bytes < 1:
        raise ValueError(f"buffers and buffer_bytes must be positive, got {buffers} and {buffer_bytes}")
    order = {id(f): i for i, f in enumerate(files.files)}
    jobs = sorted((_narrowed(files.tensors[n], plan[n]) for n in plan if n in files.tensors),
                  key=lambda job: (order[id(job[0].file)], job[0].start))
    label = f"loading {shown(files.source.parent, 200)}"
    return _Stream(jobs, device, buffers, buffer_bytes, Progress(label, progress)).run()


LM_HEAD = "lm_head.weight"
_CODES = {view: code for code, (_, view) in reversed(DTYPES.items())}   # NumPy dtype name -> safetensors dtype


@dataclass(frozen=True)
class Piece:
    """A tensor a file keeps in another form than ours: `shape` in the file, written into ours[index] (a view) by
    `transform(src, out)` (None: copied as it is)."""

    ours: str
    shape: tuple[int, ...]
    index: tuple = ()
    transform: Callable | None = None
    part: tuple[int, ...] | None = None     # Target.part: only this slice of the file's tensor (a shard of ours)


def load_weights(checkpoint: Checkpoint, shapes: Mapping[str, tuple[int, ...]], *, dtype: str, outs=None,
                 prefix: str = "", tied: str | None = None, ignore: tuple[str, ...] = (), device=None,
                 expected: str = "the model", stored: Callable | None = None,
                 rewrite: Callable[[dict, Mapping | None, Mapping[str, str]], dict] | None = None,
                 parts: Mapping[str, tuple[int, int, int]] | None = None) -> dict:
    """A model's weights from a checkpoint, under the names of `shapes`: load_tensors with a family's rules.

    The file names every tensor with `prefix` before it or none without (GPT2LMHeadModel's names or GPT2Model's).
    A model whose LM head is tied to its embedding (`tied`: the embedding's name) may find an lm_head.weight in
    the file, which must equal the embedding bit for bit and is dropped. Names ending in one of `ignore` are
    buffers, skipped. `outs`: our name -> the array to fill, or a function returning that mapping, called once
    the headers have been checked (so nothing is allocated for a file that does not match); None: new arrays of
    `dtype`. `stored(names in the file)`: file name -> Piece, for tensors the file keeps in another form than ours
    (ours is then made whole from its pieces). `rewrite(plan, outs, dtypes)`: the plan (file names; a piece's
    target keeps its transform) as some tensors are really stored or converted (e.g. quantized weights and their
    scales, tilekit.models.quantization), given the file's safetensors dtypes by name; called before and after
    `outs` exist (None before). `parts`: our name -> (axis, start, stop[, groups]), the slice of the file's tensor
    to load (Target.part: a tensor-parallel rank's shard; its array has the slice's shape); a piece of a sharded
    tensor of ours says which slice of its file tensor that is (Piece.part: `stored` was given the parts); a
    rewrite keeps each target's part and gives the tensors it adds (e.g. scales) the matching slices.
    Returns our name -> array."""
    parts = parts or {}
    with checkpoint.tensor_files() as files:
        p = prefix if prefix and any(name.startswith(prefix) for name in files.tensors) else ""
        pieces = stored(set(files.tensors)) if stored else {}
        unsliced = sorted(name for name, q in pieces.items() if q.ours in parts and q.part is None)
        if unsliced:
            raise ValueError(f"stored pieces {unsliced} of sharded tensors name no part of their file tensors")
        pieced = {q.ours for q in pieces.values()}
        whole = {name: shape for name, shape in shapes.items() if name not in pieced}

        dtypes = {name: info.dtype for name, info in files.tensors.items()}

        def plan_for(outs) -> dict:
            plan = {p + name: Target(shape, dtype, None if outs is None else outs[name],
                                   part=parts.get(name))
                    for name, shape in whole.items()}
            plan.update({name: Target(q.shape, dtype) if outs is None else
                         Target(q.shape, dtype, outs[q.ours][q.index], q.transform, part=q.part)
                         for name, q in pieces.items()})
            return rewrite(plan, outs, dtypes) if rewrite is not None else plan
        plan = plan_for(None)
        if tied is not None:
            plan[LM_HEAD] = Target(shapes[tied], dtype, optional=True)
        problems = tensor_problems({n: (t.dtype, t.shape) for n, t in files.tensors.items()}, plan, ignore)
        if problems:
            raise ModelFileError(files.source, listing(f"does not match {expected}", problems))
        outs = outs() if callable(outs) else outs
        if outs is None and pieces:
            device = device or CupyDevice()
            outs = {name: device.empty(part_shape(shape, parts[name]) if name in parts else shape, dtype)
                    for name, shape in shapes.items()}
        if outs is not None:
            plan.update(plan_for(outs))
        loaded = load_tensors(files, plan, device=device, ignore=ignore, expected=expected)
        if tied is not None and LM_HEAD in loaded and not _same_bits(loaded[LM_HEAD], loaded[p + tied]):
            raise ModelFileError(files.source, f"tensor {quoted(LM_HEAD)} differs from {quoted(p + tied)}, to which "
                                               "this model ties its LM head")
    return {name: loaded[p + name] if name in whole else outs[name] for name in shapes}


def _same_bits(a, b) -> bool:
    """Whether two arrays (NumPy or CuPy) of one dtype and shape hold the same bits."""
    uint = f"u{a.dtype.itemsize}"
    return bool((a.view(uint) == b.view(uint)).all())


def check_arrays(shapes: Mapping[str, tuple[int, ...]], arrays: Mapping, heading: str) -> None:
    """ValueError, `heading` first, listing every missing, unexpected, misshapen or non-float array of `arrays`
    (NumPy or device arrays) against the names and shapes of `shapes`."""
    def described(a):
        dtype = str(getattr(a, "dtype", type(a).__name__))
        return _CODES.get(dtype, dtype), tuple(getattr(a, "shape", ()))
    plan = {name: Target(shape, accept=FLOATS + ("F64",)) for name, shape in shapes.items()}
    problems = tensor_problems({name: described(a) for name, a in arrays.items()}, plan)
    if problems:
        raise ValueError(listing(heading, problems))


def decoder_shapes(config, block_shapes: Callable, embedding: str, final_norm: str = "model.norm.weight") -> dict:
    """Name -> shape of every tensor of a decoder of transformers' Llama-like naming: the token embedding, each layer's
    block_shapes(config, i), the final norm, and lm_head unless tied to the embedding."""
    C, V = config.n_embd, config.vocab_size
    shapes = {embedding: (V, C)}
    for i in range(config.n_layer):
        shapes.update(block_shapes(config, i))
    shapes[final_norm] = (C,)
    if not config.tie_word_embeddings:
        shapes[LM_HEAD] = (V, C)
    return shapes


@dataclass(frozen=True)
class CheckpointLayout:
    """How one family's weights sit in Hugging Face checkpoints, and what is done with them. `shapes(config)`:
    our name -> shape of every tensor (a tied LM head excluded); `stats(config, name)`: (mean, std) of random
    weights; `prefix`: what the file may put before our names; `embedding`: the tensor a tied LM head is;
    `buffers`: name suffixes of buffers old checkpoints carry; `hub_orgs`: where a bare hub name is also looked
    up; `stored(config, names in a file, parts)`: the file's tensors kept in another form than ours (load_weights; a
    tensor-parallel rank's `parts` of ours, {} for a whole model, say which slices of them to read) and
    `to_file(config, state)`: ours in the file's form (what save writes), where a family's layout differs from the
    file's. A family's weights module exposes these methods as its functions."""

    config_class: type
    shapes: Callable[..., dict]
    stats: Callable[..., tuple[float, float]]
    embedding: str
    prefix: str = ""
    buffers: tuple[str, ...] = ()
    hub_orgs: tuple[str, ...] = ()
    stored: Callable | None = None
    to_file: Callable | None = None

    def resolve(self, path_or_name) -> Checkpoint:
        """A checkpoint: a directory, or a hub model name in the local cache (a bare name also under hub_orgs)."""
        return find_checkpoint(path_or_name, self.hub_orgs)

    def load(self, checkpoint: Checkpoint, config, *, dtype: str, outs=None, device=None, rewrite=None,
             ignore: tuple[str, ...] = (), parts: Mapping | None = None) -> dict:
        """The checkpoint's weights as arrays of `dtype` under our names (load_weights: `outs`, `device`,
        `rewrite`, `parts`); a tied model's lm_head.weight, if the file has one, checked and dropped. BF16, FP16
        and FP32 tensors load, from one file or from shards; names ending in one of `ignore` are read past."""
        return load_weights(checkpoint, self.shapes(config), dtype=dtype, outs=outs, device=device,
                            prefix=self.prefix, tied=self.embedding if config.tie_word_embeddings else None,
                            ignore=self.buffers + ignore, expected=str(config), rewrite=rewrite, parts=parts,
                            stored=self.stored and (lambda names: self.stored(config, names, parts or {})))

    def load_state_dict(self, path_or_name, dtype=np.float32) -> tuple:
        """(config, host tensors: our names, C-contiguous, float32 or float64) of a checkpoint."""
        checkpoint = self.resolve(path_or_name)
        config = self.config_class.from_fields(checkpoint.config())
        return config, self.load(checkpoint, config, dtype=float_dtype(dtype).name, device=HostDevice())

    def save_state_dict(self, directory, config, state: Mapping, dtype: str = "float32",
                        shard_bytes: int | None = None) -> None:
        """Write config.json and the weights (in `dtype`, from host or device arrays; model.safetensors, or shards
        of at most `shard_bytes` and their index) as the family's transformers class's save_pretrained does."""
        self.check_state_dict(config, state)
        if self.to_file is not None:
            state = self.to_file(config, state)
        write_checkpoint(directory, dict(config.to_hf_dict(), torch_dtype=dtype),
                         {self.prefix + name: array for name, array in state.items()}, dtype=dtype,
                         shard_bytes=shard_bytes)

    def check_state_dict(self, config, state: Mapping) -> None:
        """ValueError listing every missing, unexpected, misshapen or non-float array of `state`."""
        check_arrays(self.shapes(config), state, f"state dict does not match {config}")

    def random_state_dict(self, config, seed: int, dtype=np.float32) -> dict[str, np.ndarray]:
        """Random host weights as `stats` scales them, deterministic for `seed`."""
        return random_tensors(self.shapes(config), seed, dtype, lambda name: self.stats(config, name))


class _Stream:
    """One load: pieces of tensors read into a ring of staging buffers by worker threads, copied to the device in
    order, and converted there when a tensor's last piece has arrived. A staging buffer is read into again only
    after the device has finished copying out of it."""

    def __init__(self, jobs: list[tuple[TensorInfo, Target]], device, buffers: int, buffer_bytes: int, progress):
        self.jobs, self.device, self.progress = jobs, device, progress
        largest = max((info.nbytes for info, _ in jobs), default=0)
        self.size = max(1, min(buffer_bytes, largest))
        self.pieces = [(j, lo, min(lo + self.size, info.nbytes))
                       for j, (info, _) in enumerate(jobs) for lo in range(0, max(info.nbytes, 1), self.size)]
        self.ring = [device.staging(self.size) for _ in range(min(buffers, len(self.pieces)))]
        self.scratch = None
        self.out = {}
        self.finite_checks = []          # (tensor, problem, device flag: whether it has that problem)

    def read(self, k: int, copied) -> None:
        """Piece k into its staging buffer, once `copied()` says the device is done with that buffer."""
        if copied is not None:
            copied()
        j, lo, hi = self.pieces[k]
        info = self.jobs[j][0]
        info.file.readinto(memoryview(self.ring[k % len(self.ring)])[:hi - lo], info.start + lo)

    def begin(self, info: TensorInfo, target: Target):
        """The tensor's output array, the raw device bytes its pieces are copied into, and whether those are the
        output itself (it needs no conversion) rather than a scratch buffer."""
        device = self.device
        with device.context():
            out = target.out() if callable(target.out) else target.out
            if out is None:
                out = device.empty(target.shape, target.dtype)
        _check_target(info.name, target, out)
        if (target.transform is None and DTYPES[info.dtype][1] == str(out.dtype) and out.flags.c_contiguous
                and out.nbytes == info.nbytes):
            return out, device.raw(out), True
        if self.scratch is None or self.scratch.nbytes < info.nbytes:
            self.scratch = device.empty((info.nbytes,), "uint8")
        return out, self.scratch[:info.nbytes], False

    def finish(self, info: TensorInfo, target: Target, out, raw) -> None:
        """Convert or transform the tensor from scratch into its output (queued on the device after the copies)."""
        src = raw.view(numpy_dtype(DTYPES[info.dtype][1])).reshape(info.shape)
        with self.device.context():
            try:
                (target.transform or convert)(src, out)
            except TensorValueError as e:
                raise ModelFileError(info.file.path, f"tensor {quoted(info.name)} {e}") from None

    def run(self) -> dict:
        ring, device = self.ring, self.device
        if not ring:
            return self.out
        copied = [None] * len(ring)
        pool = ThreadPoolExecutor(len(ring), thread_name_prefix="tilekit-load")
        try:
            reads = deque(pool.submit(self.read, k, None) for k in range(len(ring)))
            done, total = 0, sum(info.nbytes for info, _ in self.jobs)
            for k, (j, lo, hi) in enumerate(self.pieces):
                info, target = self.jobs[j]
                if lo == 0:
                    out, raw, direct = self.begin(info, target)
                reads.popleft().result()
                slot = k % len(ring)
                if hi > lo:
                    copied[slot] = device.upload(ring[slot][:hi - lo], raw[lo:hi])
                if k + len(ring) < len(self.pieces):
                    reads.append(pool.submit(self.read, k + len(ring), copied[slot]))
                if hi == info.nbytes:
                    self.check_finite(info, raw, "holds a value that is not finite",
                                      FLOAT_BITS.get(info.dtype, DTYPES[info.dtype][1]))
                    if not direct:
                        self.finish(info, target, out, raw)
                        if target.transform is None:       # (transforms check their own outputs)
                            self.check_finite(info, out, f"holds a value too large for {out.dtype}")
                    self.out[info.name] = out
                done += hi - lo
                self.progress.update(done, total)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            device.synchronize()
            self.progress.close()
        for info, problem, flag in self.finite_checks:      # the file's values before what conversion made
            if bool(flag):
                raise ModelFileError(info.file.path, f"tensor {quoted(info.name)} {problem}")
        return self.out

    def check_finite(self, info: TensorInfo, array, problem: str, dtype: str | None = None) -> None:
        """Queue a check that `array` (bytes of float `dtype`, default its own) holds no infinity or NaN."""
        dtype = dtype or str(array.dtype)
        if dtype in EXPONENT_BITS:
            with self.device.context():
                self.finite_checks.append((info, problem, self.device.any_nonfinite(array, dtype)))


class HostDevice:
    """The loader's device played by host memory: NumPy outputs (references, tools, CPU tests). Its methods are
    what load_tensors asks of a device; CupyDevice has the same."""

    dtypes = TARGET_DTYPES

    def staging(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, np.uint8)

    def empty(self, shape, dtype: str) -> np.ndarray:
        return np.empty(shape, numpy_dtype(dtype))

    def raw(self, array) -> np.ndarray:
        """The bytes of a C-contiguous array, as a flat uint8 view."""
        return array.reshape(-1).view(np.uint8)

    def upload(self, host: np.ndarray, raw: np.ndarray) -> Callable[[], None] | None:
        """Copy host bytes into raw device bytes; returns a function waiting until `host` may be reused."""
        raw[...] = host
        return None

    def context(self):
        """What conversions run under (the copy stream on a GPU)."""
        return contextlib.nullcontext()

    def any_nonfinite(self, array, dtype: str) -> bool:
        """Whether `array`, the bytes of values of float `dtype`, holds an infinity or a NaN (CupyDevice: a device
        flag, read after the load)."""
        uint, bits = EXPONENT_BITS[dtype]
        v = array.view(uint).reshape(-1) if array.ndim < 2 else array.view(uint)
        rows = max(1, (1 << 14) // max(1, v[0].size)) if v.size else 1     # blocks of about 16K values: little memory
        return any(((v[i:i + rows] & np.array(bits, uint)) == bits).any() for i in range(0, len(v), rows))

    def synchronize(self) -> None:
        pass


class CupyDevice:
    """The loader's GPU side: pinned staging buffers, and copies and conversions queued on one stream of the
    current device. No float64 targets: no GPU model computes in it, and on an H100 the conversions into it
    from bf16 and fp32 files did not match NumPy's bit for bit (a subnormal among the values tested)."""

    dtypes = ("bfloat16", "float16", "float32")

    def __init__(self):
        import cupy
        self.cupy = cupy
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.exponent_all_set = cupy.ReductionKernel("T x, T bits", "bool y", "(x & bits) == bits", "a || b",
                                                     "y = a", "false", "tilekit_exponent_all_set")

    def staging(self, nbytes: int) -> np.ndarray:
        cuda = self.cupy.cuda
        return np.frombuffer(cuda.PinnedMemoryPointer(cuda.PinnedMemory(nbytes), 0), np.uint8, nbytes)

    def empty(self, shape, dtype: str):
        with self.stream:
            return self.cupy.empty(shape, numpy_dtype(dtype))

    def raw(self, array):
        return self.cupy.ndarray((array.nbytes,), self.cupy.uint8, array.data)

    def upload(self, host: np.ndarray, raw):
        runtime = self.cupy.cuda.runtime
        runtime.memcpyAsync(raw.data.ptr, host.ctypes.data, host.nbytes, runtime.memcpyHostToDevice, self.stream.ptr)
        event = self.cupy.cuda.Event(disable_timing=True)
        event.record(self.stream)
        return event.synchronize

    def context(self):
        return self.stream

    def any_nonfinite(self, array, dtype: str):
        uint, bits = EXPONENT_BITS[dtype]
        return self.exponent_all_set(array.view(uint), self.cupy.dtype(uint).type(bits))

    def synchronize(self) -> None:
        self.stream.synchronize()


class Progress:
    """A one-line progress bar on stderr, drawn once a load has run `after` seconds, only on a terminal."""

    def __init__(self, label: str, enabled: bool = True, stream=None, after: float = 2.0, clock=time.monotonic):
        self.stream = sys.stderr if stream is None else stream
        self.on = enabled and bool(getattr(self.stream, "isatty", lambda: False)())
        self.label, self.after, self.clock = label, after, clock
        self.start, self.drawn = clock(), None

    def update(self, done: int, total: int) -> None:
        if not self.on:
            return
        now = self.clock()
        if now - self.start < self.after or (self.drawn is not None and now - self.drawn < 0.1 and done < total):
            return
        rate = done / 1e9 / max(now - self.start, 1e-9)
        self.stream.write(f"\r{self.label}: {100 * done // max(total, 1):3d}% {done / 1e9:.1f}/{total / 1e9:.1f} GB"
                          f" {rate:.1f} GB/s ")
        self.stream.flush()
        self.drawn = now

    def close(self) -> None:
        if self.drawn is not None:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn = None


# -- writing ------------------------------------------------------------------------------------------------

def write_checkpoint(directory, hf_config: dict, tensors: Mapping[str, np.ndarray], *, dtype: str = "float32",
                     shard_bytes: int | None = None, raw: Mapping[str, str] | None = None) -> None:
    """Write config.json and the tensors (NumPy arrays, or CuPy ones: each converted on the device and copied to
    the host alone) in `dtype` (float32, bfloat16 or float16) as save_pretrained does:
    model.safetensors, or with `shard_bytes` shards model-0000i-of-0000n.safetensors of at most that size (a
    larger tensor alone) and model.safetensors.index.json. Weights files of the other layout are removed. Each
    file is written under a temporary name and renamed into `directory`: a link there is replaced, never
    written through. One tensor at a time is converted, so views of one buffer cost no memory. `raw`: name ->
    safetensors dtype of tensors written as they are (quantized codes as I8 or F8_E4M3 from int8 or uint8 arrays,
    fp32 scales as F32), each of that dtype's item size."""
    if dtype not in _WRITE_DTYPES:
        raise ValueError(f"dtype must be one of {tuple(_WRITE_DTYPES)}, got {dtype!r}")
    raw = dict(raw or {})
    for name, code in raw.items():
        if code not in DTYPES or np.dtype(tensors[name].dtype).itemsize != DTYPES[code][0]:
            raise ValueError(f"tensor {quoted(name)}: a {tensors[name].dtype} array cannot be written as {code}")
    config_text = json.dumps(hf_config, indent=2, allow_nan=False) + "\n"
    itemsize = np.dtype(numpy_dtype(dtype)).itemsize
    sizes = {name: math.prod(np.shape(a)) * (DTYPES[raw[name]][0] if name in raw else itemsize)
             for name, a in tensors.items()}
    shards: list[list[str]] = [[]]
    for name, nbytes in sizes.items():
        if shard_bytes is not None and shards[-1] and sum(sizes[n] for n in shards[-1]) + nbytes > shard_bytes:
            shards.append([])
        shards[-1].append(name)
    names = [WEIGHTS_NAME] if shard_bytes is None else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                                         for i in range(len(shards))]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _write_file(directory, CONFIG_NAME, [config_text.encode()])
    for file_name, shard in zip(names, shards):
        _write_file(directory, file_name, _safetensors_bytes({n: tensors[n] for n in shard}, dtype, sizes, raw))
    if shard_bytes is not None:
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {n: file_name for file_name, shard in zip(names, shards) for n in shard}}
        _write_file(directory, INDEX_NAME, [(json.dumps(index, indent=2, sort_keys=True) + "\n").encode()])
    for entry in os.scandir(directory):
        if (_SHARD.fullmatch(entry.name) or entry.name == INDEX_NAME) and entry.name not in names + (
                [INDEX_NAME] if shard_bytes is not None else []):
            os.unlink(entry.path)


def _safetensors_bytes(tensors: Mapping[str, np.ndarray], dtype: str, sizes: Mapping[str, int],
                       raw: Mapping[str, str]):
    """A safetensors file's bytes in pieces: the header (padded to 8 bytes, format "pt" as transformers wants),
    then each tensor converted as it is reached (those in `raw` as they are)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, array in tensors.items():
        header[name] = {"dtype": raw.get(name, _WRITE_DTYPES[dtype]), "shape": list(np.shape(array)),
                        "data_offsets": [offset, offset + sizes[name]]}
        offset += sizes[name]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    yield len(text).to_bytes(8, "little") + text
    for name, array in tensors.items():
        array = array if hasattr(array, "astype") else np.asarray(array)
        if name not in raw:
            array = array.astype(numpy_dtype(dtype), copy=False)     # a device array: converted there
        yield np.ascontiguousarray(array.get() if hasattr(array, "get") else array).reshape(-1).view(np.uint8)


def _write_file(directory: Path, name: str, pieces) -> None:
    """Write `pieces` to a temporary file in `directory`, then rename it to `name`."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        with open(fd, "wb") as f:
            for piece in pieces:
                f.write(piece)
        os.replace(tmp, directory / name)
    except BaseException:
        os.unlink(tmp)
        raise


def random_tensors(shapes: Mapping[str, tuple[int, ...]], seed: int, dtype, stats) -> dict[str, np.ndarray]:
    """N(mean, std) tensors of `shapes`, drawn in order from one generator seeded with `seed`;
    stats(name) -> (mean, std)."""
    rng = np.random.default_rng(seed)
    state = {}
    for name, shape in shapes.items():
        mean, std = stats(name)
        state[name] = (mean + std * rng.standard_normal(shape)).astype(dtype)
    return state

