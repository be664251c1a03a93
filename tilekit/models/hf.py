"""Hugging Face checkpoint files, for every model family: find a checkpoint on disk (a directory or the hub
cache), read its config.json and safetensors files (single-file or sharded), check config fields and tensors,
write checkpoints and make random ones. Every file read is untrusted input; nothing here names a family.

A checkpoint is a directory holding config.json and model.safetensors, or model.safetensors.index.json and the
shards it names, as save_pretrained writes it or as the Hugging Face hub cache stores it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from collections import Counter
from pathlib import Path

import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
MAX_JSON_BYTES = 16 << 20  # config.json and safetensors indexes are small; a larger file is refused unread
MAX_SIZE = 1 << 24         # no model dimension comes near; a config file claiming more is refused
MAX_LAYERS = 4096
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)  # importing ml_dtypes also lets safetensors.numpy read BF16 tensors


# -- config.json ------------------------------------------------------------------------------------------

def read_json(path: str | Path, what: str) -> dict:
    """The JSON object in `path`, an untrusted file: ValueError naming it if it is unreadable, too large,
    not strict JSON, not an object or repeats a key (json would silently keep the last)."""
    path = Path(path)

    def strict(pairs):
        d = dict(pairs)
        if len(d) < len(pairs):
            raise ValueError(f"repeated key {next(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)!r}")
        return d

    def no_constant(name):
        raise ValueError(f"{name} is not JSON")

    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            raise ValueError(f"larger than {MAX_JSON_BYTES} bytes")
        d = json.loads(path.read_bytes(), object_pairs_hook=strict, parse_constant=no_constant)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"cannot read {what} {path}: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"cannot read {what} {path}: a JSON object expected, got {type(d).__name__}")
    return d


@contextlib.contextmanager
def hf_config_fields(d: dict, unsupported: dict[str, bool], family: str):
    """Reading a Hugging Face config.json dict `d`: ValueError naming every key whose value asks for a
    variant tilekit does not compute (`unsupported`: key -> is it such a value), then, within the block,
    naming a required key the file lacks."""
    bad = [f"{k}={d[k]!r}" for k, is_bad in unsupported.items() if is_bad]
    if bad:
        raise ValueError(f"config.json asks for a {family} variant tilekit does not compute: {', '.join(bad)}")
    try:
        yield
    except KeyError as e:
        raise ValueError(f"config.json lacks the {family} key {e.args[0]!r}") from None


def check_positive_ints(config, names) -> None:
    """ValueError naming the first of `names` whose value in `config` is not a positive int (bools are
    not) of plausible size (a hostile config.json must not make the shape checks run for hours)."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{type(config).__name__}.{name} must be a positive int, got {value!r}")
        most = MAX_LAYERS if name == "n_layer" else MAX_SIZE
        if value > most:
            raise ValueError(f"{type(config).__name__}.{name} = {value} is larger than any model tilekit runs "
                             f"(at most {most})")


def check_number(owner, name: str, low: float = 0.0) -> None:
    """ValueError unless owner.name is a finite real number greater than `low` (bools are not numbers)."""
    value = getattr(owner, name)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= low:
        raise ValueError(f"{type(owner).__name__}.{name} must be a finite number > {low}, got {value!r}")


# -- finding a checkpoint ---------------------------------------------------------------------------------

def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, located the way huggingface_hub locates it."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "huggingface" / "hub"


def resolve_checkpoint(path_or_name: str | Path, weights: tuple[str, ...], orgs: tuple[str, ...]) -> Path:
    """Directory of a checkpoint (config.json and one of `weights`): `path_or_name` itself, or a hub model
    name found in the local cache. Never touches the network. A bare name like "gpt2" is also looked up under
    each of `orgs` ("openai-community/gpt2").
    """
    path = Path(path_or_name).expanduser()
    if path.is_dir():
        missing = _lacks(path, weights)
        if missing:
            raise FileNotFoundError(f"checkpoint directory {path} lacks {', '.join(missing)}")
        return path
    searched = [str(path)]
    name = str(path_or_name)
    if _HUB_NAME.fullmatch(name):
        for repo_id in [name] + ([f"{org}/{name}" for org in orgs] if "/" not in name else []):
            repo = hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))
            snapshot = _cached_snapshot(repo, weights)
            if snapshot is not None:
                return snapshot
            searched.append(str(repo / "snapshots"))
    raise FileNotFoundError(f"no checkpoint ({CONFIG_NAME} + {' or '.join(weights)}) for {name!r}; searched: "
                            + ", ".join(searched))


def _lacks(directory: Path, weights: tuple[str, ...]) -> list[str]:
    """What `directory` lacks of a checkpoint: config.json, one of `weights`."""
    missing = [] if (directory / CONFIG_NAME).is_file() else [CONFIG_NAME]
    return missing + ([] if any((directory / w).is_file() for w in weights) else [" or ".join(weights)])


def _cached_snapshot(repo: Path, weights: tuple[str, ...]) -> Path | None:
    """The hub-cache snapshot of `repo` that is complete: refs/main's revision first, then the newest."""
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    candidates = sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
    ref = repo / "refs" / "main"
    if ref.is_file():
        candidates.insert(0, snapshots / ref.read_text().strip())
    for snapshot in candidates:
        if not _lacks(snapshot, weights):
            return snapshot
    return None


# -- reading tensors ----------------------------------------------------------------------------------------

def float_dtype(dtype) -> np.dtype:
    """`dtype` as a NumPy dtype, which must be float32 or float64: what checkpoints load as."""
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise ValueError(f"dtype must be float32 or float64, got {dtype}")
    return dtype


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file (BF16 ones as ml_dtypes.bfloat16); ValueError naming a bad file."""
    try:
        return safetensors.numpy.load_file(path)
    except (safetensors.SafetensorError, OSError, TypeError) as e:  # TypeError: a dtype NumPy does not know
        raise ValueError(f"cannot read safetensors file {path}: {e}") from None


def read_checkpoint_tensors(directory: Path, skip_suffixes: tuple[str, ...] = ()) -> tuple[Path, dict]:
    """(source, every tensor of a checkpoint directory but those whose names end in `skip_suffixes`).

    As in transformers, model.safetensors wins over an index; with an index (the source then), every tensor
    must sit in the one shard the index maps it to.
    """
    source = directory / WEIGHTS_NAME
    if source.is_file():
        files = {source: None}
    else:
        source = directory / INDEX_NAME
        files = shard_files(source)
    state = {}
    for path, listed in files.items():
        tensors = read_safetensors(path)
        if listed is not None and tensors.keys() != listed:
            problems = [f"{what} {names[:5]}" + (f" and {len(names) - 5} more" if len(names) > 5 else "")
                        for what, names in (("holds tensors the index maps elsewhere or not at all",
                                             sorted(tensors.keys() - listed)),
                                            ("lacks tensors the index maps to it", sorted(listed - tensors.keys())))
                        if names]
            raise ValueError(f"shard {path} does not match {source}: it {'; it '.join(problems)}")
        state.update((name, a) for name, a in tensors.items() if not name.endswith(skip_suffixes))
    return source, state


def shard_files(index: Path) -> dict[Path, set[str]]:
    """The shards a safetensors index names, each with the tensor names the index maps to it.

    The index is untrusted: each shard must be a plain file name of a regular file in the index's directory (in
    a hub cache snapshot, a link into the repository's blobs), and no two names may be the same file.
    """
    weight_map = read_json(index, "safetensors index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(shard, str) for shard in weight_map.values()):
        raise ValueError(f"safetensors index {index}: 'weight_map' must be a non-empty object of tensor name -> "
                         "shard file name")
    directory = index.parent
    # huggingface_hub links a snapshot's files to ../../blobs/: the repository folder is what they must stay in.
    root = directory.resolve()
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        root = root.parent.parent
    files, seen = {}, {}
    for shard in sorted(set(weight_map.values())):
        real = _shard_file(directory, root, shard)
        if real is None:
            raise ValueError(f"safetensors index {index} names shard {shard!r}, which is not a file in {directory}")
        if real in seen:
            raise ValueError(f"safetensors index {index} names one file twice: {seen[real]!r} and {shard!r}")
        seen[real] = shard
        files[directory / shard] = {name for name, s in weight_map.items() if s == shard}
    return files


def _shard_file(directory: Path, root: Path, shard: str) -> Path | None:
    """The real path of `shard`, or None unless it is a plain file name of a regular file that stays in `root`."""
    if shard in ("", ".", "..") or any(c in shard for c in "/\\\0"):
        return None
    try:
        real = (directory / shard).resolve()
        return real if real.is_relative_to(root) and real.is_file() else None
    except (OSError, RuntimeError):  # a name too long; a link loop (RuntimeError before Python 3.13)
        return None


# -- checking, writing and making tensors -------------------------------------------------------------------

def check_tensors(expected: dict[str, tuple[int, ...]], state: dict, heading: str) -> None:
    """Raise ValueError, `heading` first, listing every missing, unexpected, misshapen or non-float tensor."""
    problems = []
    for name, array in state.items():
        if name not in expected:
            problems.append(f"unexpected tensor {name!r}")
        elif not isinstance(array, np.ndarray) or not (np.issubdtype(array.dtype, np.floating)
                                                       or array.dtype == BFLOAT16):
            problems.append(f"tensor {name!r} must be a floating-point numpy array, "
                            f"got {getattr(array, 'dtype', type(array).__name__)}")
        elif array.shape != expected[name]:
            problems.append(f"tensor {name!r} has shape {array.shape}, expected {expected[name]}")
    # Missing names go last: a wrong prefix or size shows in the first lines.
    problems += [f"missing tensor {name!r} (shape {shape})" for name, shape in expected.items() if name not in state]
    if problems:
        shown = "\n  ".join(problems[:10]) + (f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else "")
        raise ValueError(f"{heading}:\n  {shown}")


def pop_tied_lm_head(state: dict, embedding: str, source: str) -> None:
    """Drop the lm_head.weight some checkpoints of a tied model carry; ValueError if it differs from `embedding`."""
    lm_head = state.pop("lm_head.weight", None)
    if lm_head is not None and embedding in state and not np.array_equal(lm_head, state[embedding]):
        raise ValueError(f"tensor 'lm_head.weight' in {source} differs from {embedding!r}, "
                         "to which this model ties its LM head")


def write_checkpoint(directory: str | Path, hf_config: dict, tensors: dict[str, np.ndarray]) -> None:
    """Write config.json and a float32 model.safetensors, as Hugging Face save_pretrained does."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_NAME).write_text(json.dumps(hf_config, indent=2) + "\n")
    tensors = {name: np.ascontiguousarray(array, dtype=np.float32) for name, array in tensors.items()}
    # transformers refuses safetensors files whose metadata lacks the framework it was saved from.
    safetensors.numpy.save_file(tensors, directory / WEIGHTS_NAME, metadata={"format": "pt"})


def random_tensors(shapes: dict[str, tuple[int, ...]], seed: int, dtype, stats) -> dict[str, np.ndarray]:
    """N(mean, std) tensors of `shapes`, drawn in order from one generator seeded with `seed`;
    stats(name) -> (mean, std)."""
    rng = np.random.default_rng(seed)
    state = {}
    for name, shape in shapes.items():
        mean, std = stats(name)
        state[name] = (mean + std * rng.standard_normal(shape)).astype(dtype)
    return state
