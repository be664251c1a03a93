"""safetensors files: every header entry checked against its file (a known dtype, a shape of non-negative
integers, data offsets that tile the data exactly) before any tensor data is read, and a checkpoint's tensors
across model.safetensors or the shards its index names."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tilekit.checkpoints.fields import Fields, is_int
from tilekit.checkpoints.files import (INDEX_NAME, MAX_JSON_BYTES, WEIGHTS_NAME, ModelFileError, RegularFile,
                                       json_shown, plain_name_problem)
from tilekit.untrusted import parse_json, quoted

MAX_RANK = 8
# safetensors dtype -> (bytes per element, the NumPy dtype a tensor is viewed as; FP8 as its uint8 bit patterns)


DTYPES = {"BOOL": (1, "bool"), "U8": (1, "uint8"), "I8": (1, "int8"), "F8_E4M3": (1, "uint8"),
          "F8_E5M2": (1, "uint8"), "I16": (2, "int16"), "U16": (2, "uint16"), "F16": (2, "float16"),
          "BF16": (2, "bfloat16"), "I32": (4, "int32"), "U32": (4, "uint32"), "F32": (4, "float32"),
          "I64": (8, "int64"), "U64": (8, "uint64"), "F64": (8, "float64")}
FLOATS = ("BF16", "F16", "F32")                                  # what a Target accepts by default


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
        if not isinstance(shape, list) or len(shape) > MAX_RANK or not all(is_int(d) and d >= 0 for d in shape):
            raise wrong("shape", f"a list of at most {MAX_RANK} non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(is_int, offsets))
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

    def __init__(self, checkpoint):
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

    def _weight_map(self, checkpoint) -> dict[str, str]:
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
