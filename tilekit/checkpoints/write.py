"""Writing checkpoints as transformers' save_pretrained does: config.json and model.safetensors, or shards of at
most a given size with their index, each file written whole to a temporary name and renamed into place."""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Mapping

import numpy as np

from tilekit.autotune.arrays import numpy_dtype
from tilekit.checkpoints.files import CONFIG_NAME, INDEX_NAME, WEIGHTS_NAME
from tilekit.checkpoints.safetensors import DTYPES
from tilekit.untrusted import quoted

_SHARD = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")
_WRITE_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


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
