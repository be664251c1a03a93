"""Quantized linear weights for every family: the FP8 checkpoint layouts tilekit reads, calibration-free INT8 /
FP8 quantization at load time, and the compressed-tensors layout save_pretrained writes.

A quantized model holds each block linear as 8-bit codes [out, in] (int8, or FP8 e4m3 as uint8 bits) and fp32
scales, one per output channel ([out]) or per 128x128 block ([ceil(out/128), ceil(in/128)]), such that
W ~ codes * scale (tilekit.kernels.quant_linear). Checkpoints read:

* compressed-tensors ("float-quantized" FP8 / "int-quantized" INT8 weights; channel, tensor or 128x128 block
  strategy; symmetric; no group size, sparse layout or transform): `weight` + `weight_scale` ([out, 1], [1] or
  blocks); a `kv_cache_scheme` of static per-tensor 8-bit float scales: each attention layer's `k_scale` /
  `v_scale`, which an FP8 KV cache takes (read_kv_scales; other KV-cache schemes' scales are read past);
* fbgemm_fp8: `weight` + `weight_scale` [out, 1] (`input_scale_ub` read past);
* ModelOpt (`quant_method: modelopt` or hf_quant_config.json): FP8 (per-tensor `weight_scale`, a scalar),
  FP8_PER_CHANNEL_PER_TOKEN ([out, 1]) and FP8_PB_WO (blocks); static `input_scale`s are read past
  (activations are scaled per token); with `kv_cache_quant_algo: FP8`, each layer's `k_proj.k_scale` /
  `v_proj.v_scale` go to an FP8 KV cache as compressed-tensors' do (else they are read past);
* DeepSeek-style block FP8 (`quant_method: fp8`, `weight_block_size: [128, 128]`): `weight` +
  `weight_scale_inv` (blocks; despite the name a multiplier, as DeepSeek-V3 dequantizes).

Per-tensor scales become per-channel ones. A family may keep some linears in its float dtype (weights.DEQUANTIZED:
name patterns, e.g. DeepSeek-V2's routed experts, which no quantized kernel reads): a checkpoint's codes of those are
dequantized as they load (in fp32, rounded once to the model's dtype), and the file may store them either way (its
headers decide) and list them unquantized. Any other scheme (GPTQ, AWQ, bitsandbytes, int4 packings, modules
left unquantized other than the LM head) is a ModelFileError naming the scheme and the file. Load-time
quantization (`quantize="int8" | "fp8"`) quantizes each tensor on the GPU as it arrives (one tensor at a time,
never a bf16 copy of the model on the host): scale = absmax of the output channel / 127 (int8) or / 448 (e4m3).

Tensor-parallel, a rank reads only its slice of each linear's codes and the matching scales (scale_part): a
column-parallel slice (rows) takes the same rows of per-channel scales and its 128-row blocks of block scales; a
row-parallel one (columns: o_proj, down_proj) keeps per-channel scales whole and takes its 128-column blocks of
block scales. Load-time quantization quantizes each rank's slice: a column-parallel rank's codes and scales are
TP=1's rows, but a row-parallel rank's scales are the absmax of its own columns, so they (and its codes) differ
from TP=1's, each still within the per-channel bound above; the logits then differ from TP=1's within the
quantization's own error, not bit for bit. So do W8A8 prefill rows with per-channel FP8 weights: a row-parallel
rank scales each token's activations by the absmax of its own slice of the row (block scales: per 128-column
group, which whole blocks keep, so as TP=1).
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from tilekit.autotune.arrays import array_module
from tilekit.kernels.quant_linear import QBLOCK
from tilekit.kernels.quantize_fp8 import MIN_AMAX, quantize_fp8_reference
from tilekit import parallel
from tilekit import checkpoints
from tilekit.untrusted import quoted, shown

KINDS = ("int8", "fp8")
INT8_MAX = 127.0
CODE_MAX = {"int8": 128.0, "fp8": 448.0}        # the largest magnitude of a file's codes (int8's -128 too)
FILE_DTYPES = {"int8": "I8", "fp8": "F8_E4M3"}
QUANT_CONFIG = "hf_quant_config.json"           # ModelOpt's description of its checkpoints
LM_HEAD_NAMES = ("lm_head", "re:.*lm_head", "re:^lm_head$", "lm_head.weight")
LOAD_TIME = "load-time quantization"


@dataclass(frozen=True)
class Scheme:
    """How a model's linears are quantized (`weight`: int8 | fp8, `scale`: channel | block, what the kernels see)
    and, for a checkpoint, how its files store them: `file_scale` (channel | tensor | block) with `scale_shape`
    ("out1": [out, 1], "one": [1], "scalar": [], "blocks"), the scale tensor's suffix, and suffixes of
    per-linear tensors read past. `source` names the format (messages). `head`: an untied LM head is quantized too,
    in a family whose weights.QUANTIZATION.head says it can be (head_quantized): at load where asked (quantize_head;
    gpt-fast's int8 quantizes every linear, vLLM's FP8 keeps the head), or where a checkpoint stores it as codes.
    `float_head`: the config field listing the LM head unquantized, as a ModelFileError's (path, field), or None.
    `kv_scales`: the checkpoint declares static FP8 KV-cache scales, one per attention layer for keys and one for
    values (compressed-tensors' kv_cache_scheme of 8-bit floats per tensor, ModelOpt's kv_cache_quant_algo FP8),
    which an FP8 KV cache takes (read_kv_scales); other KV-cache schemes' tensors are read past."""

    weight: str
    scale: str = "channel"
    source: str = LOAD_TIME
    scale_shape: str = "out1"
    scale_name: str = "weight_scale"
    ignored: tuple[str, ...] = ()
    head: bool = False
    float_head: tuple | None = field(default=None, compare=False)
    kv_scales: bool = False

    def scale_file_shape(self, shape: tuple[int, int]) -> tuple[int, ...]:
        out, k = shape
        return {"out1": (out, 1), "one": (1,), "scalar": (), "blocks": (math.ceil(out / QBLOCK),
                                                                         math.ceil(k / QBLOCK))}[self.scale_shape]


def model_scale_shape(scale: str, shape: tuple[int, int]) -> tuple[int, ...]:
    """The model's fp32 scale array of an [out, in] weight: [out] per channel, the block grid per block."""
    out, k = shape
    return (out,) if scale == "channel" else (math.ceil(out / QBLOCK), math.ceil(k / QBLOCK))


# -- reading a checkpoint's scheme ---------------------------------------------------------------------------

READ = ("tilekit reads FP8 / INT8 checkpoints of compressed-tensors (float-quantized, int-quantized), fbgemm_fp8, "
        "ModelOpt FP8 and block FP8 (quant_method fp8, 128x128 weight_block_size)")


def _unsupported(fields: checkpoints.Fields, key: str, what: str = "a scheme tilekit does not read") -> checkpoints.ModelFileError:
    """The error for a scheme tilekit does not read, naming the field, its value and the file."""
    return fields.error(key, f"is {checkpoints.json_shown(fields.d.get(key))}: {what}; {READ}")


def _only_lm_head(fields: checkpoints.Fields, key: str, mixed: bool) -> tuple | None:
    """A list of modules left unquantized may name the LM head only (tilekit quantizes every block linear), or,
    for a family that keeps some linears in its float dtype (`mixed`), anything: the headers decide there.
    Returns (path, field) where the list names the LM head (Scheme.float_head), else None. Names are compared as
    text: a file's 're:' pattern is never compiled (nested quantifiers could hang the regex engine)."""
    names = fields.d.get(key)
    if names is None:
        return None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise fields.error(key, "must be a list of module names")
    heads = [n for n in names if n in LM_HEAD_NAMES or n.endswith(".lm_head")]
    listed = (fields.path, fields.prefix + key) if heads else None
    if mixed:
        return listed
    others = [n for n in names if n not in heads]
    if others:
        raise fields.error(key, f"leaves modules other than the LM head unquantized ({', '.join(map(quoted, others[:3]))}"
                                f"{', ...' if len(others) > 3 else ''}), which tilekit does not support")
    return listed


def scheme_of(checkpoint: checkpoints.Checkpoint, mixed: bool = False) -> Scheme | None:
    """The quantization scheme of a checkpoint's linears, or None for a plain float checkpoint. `mixed`: the
    family keeps some linears in its float dtype (their modules may be listed unquantized)."""
    q = checkpoint.config().object("quantization_config", None)
    if q is None:
        if checkpoint.has(QUANT_CONFIG):
            path = checkpoint.directory / QUANT_CONFIG
            return _modelopt(checkpoints.Fields(checkpoint.read_json(QUANT_CONFIG), path).object("quantization"), mixed)
        return None
    method = q.d.get("quant_method")
    if not isinstance(method, str):
        raise q.error("quant_method", "must name the quantization method")
    readers = {"compressed-tensors": _compressed_tensors, "fbgemm_fp8": _fbgemm, "modelopt": _modelopt,
               "fp8": _block_fp8}
    if method not in readers:
        raise _unsupported(q, "quant_method")
    return readers[method](q, mixed)


def _compressed_tensors(q: checkpoints.Fields, mixed: bool) -> Scheme:
    fmt = q.d.get("format")
    if fmt not in ("float-quantized", "int-quantized", "naive-quantized"):
        raise _unsupported(q, "format")
    groups = q.object("config_groups")
    if len(groups.d) != 1:
        raise _unsupported(q, "config_groups", f"{len(groups.d)} groups (one is read)")
    group = groups.object(next(iter(groups.d)))
    targets = group.d.get("targets")
    if not isinstance(targets, list) or "Linear" not in targets:
        raise group.error("targets", "must include 'Linear'")
    w = group.object("weights")
    kind = {"float": "fp8", "int": "int8"}.get(w.d.get("type")) if isinstance(w.d.get("type"), str) else None
    strategy = w.d.get("strategy")
    if kind is None or not _is_exactly(w.d.get("num_bits"), 8) or w.d.get("symmetric") is not True \
            or strategy not in ("channel", "tensor", "block"):
        raise _unsupported(group, "weights", "8-bit symmetric int or float weights with channel, tensor or block "
                                             "strategy are read")
    if fmt != "naive-quantized" and fmt != {"fp8": "float-quantized", "int8": "int-quantized"}[kind]:
        raise w.error("type", f"is {quoted(w.d['type'])}, but the checkpoint's format is {quoted(fmt)}")
    if strategy == "block" and not _is_exactly(w.d.get("block_structure"), [QBLOCK, QBLOCK]):
        raise w.error("block_structure", f"must be [{QBLOCK}, {QBLOCK}]")
    group_size = w.d.get("group_size")
    if group_size is not None and not (strategy == "channel" and _is_exactly(group_size, -1)):
        raise w.error("group_size", f"is {checkpoints.json_shown(group_size)}: groups of columns are not read (null, or -1 "
                                    "with strategy channel)")
    sparsity = q.d.get("sparsity_config")
    if sparsity not in (None, {}) and not (isinstance(sparsity, dict) and sparsity.get("format") == "dense"):
        raise _unsupported(q, "sparsity_config", "a sparse layout (dense weights are read)")
    if q.d.get("transform_config") not in (None, {}):
        raise _unsupported(q, "transform_config", "transforms applied as the model runs (tilekit applies none)")
    kv = q.object("kv_cache_scheme", None)
    per_tensor = kv is not None and kv.d.get("type") == "float" and _is_exactly(kv.d.get("num_bits"), 8) \
        and kv.d.get("strategy") == "tensor" and kv.d.get("dynamic") in (False, None)
    return Scheme(kind, "block" if strategy == "block" else "channel", "compressed-tensors",
                  {"channel": "out1", "tensor": "one", "block": "blocks"}[strategy],
                  ignored=(".input_scale", ".weight_zero_point", ".input_zero_point")
                  + ((".k_scale", ".v_scale") if kv is not None else ()),
                  float_head=_only_lm_head(q, "ignore", mixed), kv_scales=per_tensor)


def _fbgemm(q: checkpoints.Fields, mixed: bool) -> Scheme:
    return Scheme("fp8", "channel", "fbgemm_fp8", "out1", ignored=(".input_scale_ub",),
                  float_head=_only_lm_head(q, "modules_to_not_convert", mixed))


def _modelopt(q: checkpoints.Fields, mixed: bool) -> Scheme:
    algo = q.d.get("quant_algo")
    shapes = {"FP8": ("channel", "scalar"), "FP8_PER_CHANNEL_PER_TOKEN": ("channel", "out1"),
              "FP8_PB_WO": ("block", "blocks")}
    if not isinstance(algo, str) or algo.upper() not in shapes:
        raise _unsupported(q, "quant_algo")
    scale, shape = shapes[algo.upper()]
    return Scheme("fp8", scale, "ModelOpt " + algo.upper(), shape, ignored=(".input_scale", ".k_scale", ".v_scale"),
                  float_head=_only_lm_head(q, "exclude_modules", mixed),
                  kv_scales=q.d.get("kv_cache_quant_algo") == "FP8")


def _is_exactly(value, want) -> bool:
    """JSON `value` equals `want` with integers as integers (8.0 and true are not 8 or 1, as checkpoints.Fields reads)."""
    if isinstance(want, list):
        return isinstance(value, list) and len(value) == len(want) and all(map(_is_exactly, value, want))
    return type(value) is type(want) and value == want


def _block_fp8(q: checkpoints.Fields, mixed: bool) -> Scheme:
    if not _is_exactly(q.d.get("weight_block_size"), [QBLOCK, QBLOCK]):
        raise _unsupported(q, "weight_block_size", f"not [{QBLOCK}, {QBLOCK}]")
    if q.d.get("fmt", "e4m3") != "e4m3" or q.d.get("activation_scheme", "dynamic") != "dynamic":
        key = "fmt" if q.d.get("fmt", "e4m3") != "e4m3" else "activation_scheme"
        raise _unsupported(q, key, "block FP8 with fmt 'e4m3' and dynamic activations is read")
    return Scheme("fp8", "block", "block FP8", "blocks", "weight_scale_inv",
                  float_head=_only_lm_head(q, "modules_to_not_convert", mixed))


# -- load plans ----------------------------------------------------------------------------------------------

def check_scales(src, kind: str) -> None:
    """TensorValueError unless every scale of a file's tensor is finite, not negative and small enough that the
    largest code of `kind` times it is finite in fp32 (the kernels' weights: one beyond is an infinite weight)."""
    xp = array_module(src)
    s = src.astype(np.float32)
    with np.errstate(over="ignore"):
        top = s * np.float32(CODE_MAX[kind])
    if not bool(xp.all(xp.isfinite(top) & (s >= 0))):
        if not bool(xp.all(xp.isfinite(s) & (s >= 0))):
            raise checkpoints.TensorValueError("holds a scale that is negative or not finite")
        raise checkpoints.TensorValueError(f"holds a scale that times the largest {kind} code ({CODE_MAX[kind]:g}) overflows "
                                  "float32")


def scale_into(out, kind: str, transform: Callable | None = None) -> Callable:
    """A transform writing a file's scale tensor (any float dtype, per channel [out, 1], per tensor or blocks;
    check_scales' for codes of `kind`) into the model's fp32 scales `out`; per channel through the weight's own
    `transform` (a row permutation), so that each scale follows its row."""
    def into(src, _):
        check_scales(src, kind)
        if transform is None or out.ndim != 1:
            out[...] = src.reshape(out.shape) if src.size == out.size else src.reshape(())
            return
        rows = out.reshape(-1, 1)
        column = rows.copy()
        column[...] = src.reshape(-1, 1) if src.size == out.size else src.reshape(())
        transform(column, rows)
    return into


def quantizing(kind: str, scale, transform: Callable | None = None) -> Callable:
    """A transform quantizing a file's float weight per output channel into the codes `out`, scales into `scale`
    (after the weight's own `transform` into our layout, a row permutation, if it has one)."""
    def into(src, out):
        if transform is not None:
            ours = src.astype(np.float32)
            transform(src, ours)
            src = ours
        quantize_into(src, out, scale, kind)
    return into


@functools.cache
def _fp8_values() -> np.ndarray:
    """The fp32 value of each of the 256 FP8 e4m3 bit patterns."""
    import ml_dtypes
    return np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def code_values(codes, kind: str):
    """fp32 values of int8 codes or FP8 e4m3 bits (uint8), NumPy or CuPy (exact; 0x7F / 0xFF are NaN)."""
    if kind == "int8":
        return codes.astype(np.float32)
    if isinstance(codes, np.ndarray):
        return _fp8_values()[codes]
    import cupy
    return cupy.asarray(_fp8_values())[codes]


def expand_scale(scale, shape: tuple[int, int], layout: str):
    """A file's scale tensor (Scheme.scale_shape `layout`: [out, 1], [1], [] or 128x128 blocks) as fp32 [out, in]
    (NumPy or CuPy, as `scale`)."""
    s = scale.astype(np.float32)
    if layout == "blocks":
        return s.repeat(QBLOCK, 0).repeat(QBLOCK, 1)[:shape[0], :shape[1]]
    column = s.reshape(-1, 1) if layout == "out1" else s.reshape(1, 1).repeat(shape[0], 0)
    return column.repeat(shape[1], 1)


class Dequantizing:
    """The two transforms that write a checkpoint's quantized weight into our float array `out` (a view), in fp32
    rounded once: its codes (as values, through the weight's own `transform` into our layout) and its scale. Files
    may keep either first; whichever arrives second scales the values in place, so nothing waits on the side."""

    def __init__(self, scheme: Scheme, shape: tuple[int, int], out, transform: Callable | None):
        self.scheme, self.shape, self.out, self.transform = scheme, shape, out, transform or checkpoints.convert
        self.scale, self.values = None, False

    def codes(self, src, _) -> None:
        self.transform(code_values(src, self.scheme.weight), self.out)
        self.values = True
        self._finish()

    def scales(self, src, _) -> None:
        check_scales(src, self.scheme.weight)
        self.scale = src.copy()
        self._finish()

    def _finish(self) -> None:
        if self.scale is None or not self.values:
            return
        full = expand_scale(self.scale, self.shape, self.scheme.scale_shape)
        ours = self.out.astype(np.float32)
        factor = ours.copy()
        self.transform(full, factor)
        weights = ours * factor
        xp = array_module(weights)
        import ml_dtypes
        if not bool(xp.all(xp.abs(weights) <= float(ml_dtypes.finfo(self.out.dtype).max))):    # NaN fails too
            raise checkpoints.TensorValueError(f"dequantizes to values that {self.out.dtype} cannot hold (codes times scales: "
                                      "NaN codes, or scales too large)")
        self.out[...] = weights
        self.scale = None


def rewrite_plan(plan: Mapping[str, checkpoints.Target], linears: tuple[str, ...], scheme: Scheme, outs,
                 dtypes: Mapping[str, str] | None = None, dequantized: tuple[str, ...] = ()) -> dict:
    """A load plan (file names; checkpoints.load_weights) with every linear weight of `plan` (names in `linears`) read as
    `scheme` stores it: codes and scales from a quantized checkpoint, or float weights quantized as they arrive
    (load-time quantization). A target's own transform (a family's layout, a row permutation) still applies.
    `outs`: our name -> array (codes under the weight's name, fp32 scales under NAME_scale), or None before the
    headers are checked. From a quantized checkpoint, the weights matching `dequantized` (a family's
    DEQUANTIZED patterns) that `dtypes` (file name -> safetensors dtype) shows as codes are dequantized into
    their float targets, with their scales. A sharded target (checkpoints.Target.part, a tensor-parallel rank's slice)
    reads its slice of the codes and the matching slice of the scales (scale_part); load-time quantization
    quantizes the slice."""
    plan = dict(plan)
    loading = scheme.source == LOAD_TIME
    for name in linears:
        target = plan[name]
        shape = target.shape
        out = outs[name] if outs is not None else None
        scale = outs[scale_key(name)] if outs is not None else None
        if loading:
            plan[name] = checkpoints.Target(shape, out=out, transform=quantizing(scheme.weight, scale, target.transform),
                                   part=target.part)
            continue
        plan[name] = checkpoints.Target(shape, out=out, transform=target.transform or checkpoints.convert,
                               accept=(FILE_DTYPES[scheme.weight],), part=target.part)
        plan[name[:-len("weight")] + scheme.scale_name] = checkpoints.Target(
            scheme.scale_file_shape(shape), "float32", out=scale,
            transform=None if scale is None else scale_into(scale, scheme.weight, target.transform),
            part=scale_part(name, scheme, shape, target.part))
    if loading or not dequantized:
        return plan
    pattern = re.compile(rf"\.(?:{'|'.join(dequantized)})\.weight")
    code = FILE_DTYPES[scheme.weight]
    for name, target in list(plan.items()):
        if (dtypes or {}).get(name) != code or not pattern.search(name) or not name.endswith(".weight") \
                or len(target.shape) != 2 or name in linears:
            continue
        into = Dequantizing(scheme, target.shape, target.out, target.transform)
        plan[name] = checkpoints.Target(target.shape, target.dtype, target.out, into.codes, accept=(code,))
        plan[name[:-len("weight")] + scheme.scale_name] = checkpoints.Target(scheme.scale_file_shape(target.shape),
                                                                    "float32", transform=into.scales)
    return plan


def scale_part(name: str, scheme: Scheme, shape: tuple[int, int], part: tuple[int, ...] | None):
    """The slice of a linear's file scale tensor (Scheme.scale_shape) that goes with `part` of its [out, in] weight
    `name` (checkpoints.Target.part), or None for the whole tensor: per channel, the same rows of a column-parallel (axis
    0) slice and every scale of a row-parallel (axis 1) one; a per-tensor scale whole; block scales, the
    128-blocks of the slice's rows or columns, which must then start and end on block edges (ValueError naming
    the tensor otherwise)."""
    if part is None or scheme.scale_shape in ("one", "scalar"):
        return None
    axis, start, stop, groups = parallel.part_fields(part)
    if scheme.scale_shape == "out1":
        return part if axis == 0 else None
    if groups != 1 or start % QBLOCK or (stop % QBLOCK and stop != shape[axis]):
        what = "rows" if axis == 0 else "columns"
        raise ValueError(f"tensor {quoted(name)}: a tensor-parallel rank's {what} {start}:{stop} of {shape[axis]}"
                         f"{f' (in each of {groups} groups)' if groups != 1 else ''} are not whole {QBLOCK}-blocks "
                         f"of its block scales ({scheme.source}); such sharding needs {what} spans that are "
                         f"multiples of {QBLOCK}")
    return axis, start // QBLOCK, -(-stop // QBLOCK)


def linear_names(shapes: Mapping[str, tuple], modules: tuple[str, ...]) -> tuple[str, ...]:
    """The weights of `shapes` that belong to one of `modules` (a family's weights.QUANTIZED), in order."""
    return tuple(name for name in shapes if name.endswith(tuple(f".{m}.weight" for m in modules)))


def check_arguments(quantize, quantize_head) -> None:
    """ValueError / TypeError for a `quantize` other than None, 'int8' or 'fp8', or a `quantize_head` not a bool."""
    if quantize is not None and quantize not in KINDS:
        raise ValueError(f"quantize must be None, 'int8' or 'fp8', got {quantize!r}")
    if type(quantize_head) is not bool:
        raise TypeError(f"quantize_head must be a bool, got {quantize_head!r}")


def scheme_for(checkpoint: checkpoints.Checkpoint, quantize: str | None, mixed: bool = False,
               quantize_head: bool = False) -> Scheme | None:
    """The scheme a model loaded from `checkpoint` with `quantize` (None, "int8" or "fp8") holds: the checkpoint's
    own, or load-time per-channel quantization of a float checkpoint (`mixed`: as scheme_of), its untied LM head
    too with `quantize_head`."""
    check_arguments(quantize, quantize_head)
    scheme = scheme_of(checkpoint, mixed)
    if quantize_head and (quantize is None or scheme is not None):
        raise ValueError("quantize_head=True quantizes the LM head at load, with quantize='int8' or 'fp8' of a float "
                         "checkpoint (a quantized checkpoint's head loads as its file stores it)")
    if scheme is None:
        return None if quantize is None else Scheme(quantize, head=quantize_head)
    if quantize not in (None, scheme.weight):
        raise ValueError(f"quantize={quantize!r}, but {shown(checkpoint.directory)} holds {scheme.weight} weights "
                         f"({scheme.source})")
    return scheme


def head_quantized(weights, config, scheme: Scheme | None) -> bool:
    """Whether a model of this family (its weights module) and config holds its LM head quantized under `scheme`:
    the scheme's `head`, a family that quantizes its head (weights.QUANTIZATION.head) and an untied head."""
    return bool(scheme and scheme.head and weights.QUANTIZATION.head
                and not getattr(config, "tie_word_embeddings", True))


def check_head(model_class, config, scheme: Scheme | None) -> None:
    """ValueError where `scheme` asks for a quantized LM head that this family (or a tied head) keeps in its dtype."""
    if scheme and scheme.head and not head_quantized(model_class.weights, config, scheme):
        tied = " (tied to the token embedding)" if model_class.weights.QUANTIZATION.head else ""
        raise ValueError(f"quantize_head=True: {model_class.__name__} keeps its LM head in its dtype{tied}")


def scale_key(weight_name: str) -> str:
    """Where a model keeps a quantized weight's fp32 scales: '<module>.weight_scale'."""
    return weight_name + "_scale"


KV_SCALE_MIN = float(np.finfo(np.float32).tiny)              # a normal fp32: its reciprocal stays finite
KV_SCALE_MAX = float(np.finfo(np.float32).max) / 448      # e4m3's largest code x the scale stays finite
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale")


def kv_scale_problem(value: float) -> str | None:
    """Why `value` cannot scale an FP8 KV cache (code x scale = value), or None."""
    if math.isfinite(value) and KV_SCALE_MIN <= value <= KV_SCALE_MAX:
        return None
    return f"is {value!r}: a KV-cache scale must be between {KV_SCALE_MIN:.4g} and {KV_SCALE_MAX:.4g} (finite in " \
           "fp32, its reciprocal and e4m3's largest code times it too)"


def checked_kv_scales(scales, layers: int) -> tuple[np.ndarray, np.ndarray]:
    """CausalLM.kv_scales as (keys', values') fp32 (layers,) arrays; ValueError naming kv_scales otherwise."""
    try:
        k, v = (np.asarray(part, np.float64) for part in scales)
    except (TypeError, ValueError):
        k = v = None
    if k is None or k.ndim != 1 or v.ndim != 1:
        raise ValueError("kv_scales must be (key scales, value scales), one of each per layer")
    for name, part in (("key", k), ("value", v)):
        if part.shape != (layers,):
            raise ValueError(f"kv_scales: {part.size} {name} scales for {layers} layers")
        bad = [(i, x) for i, x in enumerate(part.tolist()) if kv_scale_problem(x)]
        if bad:
            raise ValueError(f"kv_scales: layer {bad[0][0]}'s {name} scale {kv_scale_problem(bad[0][1])}")
    return k.astype(np.float32), v.astype(np.float32)


def read_kv_scales(checkpoint: checkpoints.Checkpoint, layer_names: list[str],
                   names: tuple[tuple[str, ...], tuple[str, ...]]) -> tuple[np.ndarray, np.ndarray]:
    """A checkpoint's static FP8 KV-cache scales, which its config declares (Scheme.kv_scales): (keys', values')
    fp32 (layers,), one scale of each attention layer `layer_names[i]` (its tensors' prefix, e.g.
    'model.layers.0.'), found under one of `names` (the key scale's suffixes, the value scale's: 'self_attn.k_scale'
    as compressed-tensors writes it, 'self_attn.k_proj.k_scale' as ModelOpt does). Each must be a float scalar
    ([] or [1]) that kv_scale_problem accepts. A layer without its two scales, a scale tensor under another name
    (the weights' loader reads past every '.k_scale' / '.v_scale'), or none at all is a ModelFileError naming the
    file and the tensors. Only headers are read until those checks pass."""
    with checkpoint.tensor_files() as files:
        found, problems = {}, []
        for i, layer in enumerate(layer_names):
            for which, suffixes in enumerate(names):
                hits = [layer + suffix for suffix in suffixes if layer + suffix in files.tensors]
                if len(hits) > 1:
                    problems.append(f"tensors {' and '.join(map(quoted, hits))} both give one scale")
                elif hits:
                    found[which, i] = hits[0]
        if not found:
            raise checkpoints.ModelFileError(files.source, f"its config declares static KV-cache scales, but no tensor holds "
                                                  f"them (read: {' or '.join(map(quoted, names[0]))} and "
                                                  f"{' or '.join(map(quoted, names[1]))} of each layer)")
        for which, kind in enumerate(("key", "value")):
            have = sum((which, i) in found for i in range(len(layer_names)))
            problems += [f"missing tensor {quoted(layer_names[i] + names[which][0])} ("
                         + (f"{have} of {len(layer_names)} layers have their {kind} scale)" if have else
                            f"no layer has a {kind} scale)")
                         for i in range(len(layer_names)) if (which, i) not in found]
        problems += [f"tensor {quoted(name)} has shape {files.tensors[name].shape}: one KV-cache scale per layer "
                     f"([] or [1]) is read" for name in found.values() if files.tensors[name].shape not in ((), (1,))]
        known = set(found.values())
        problems += [f"tensor {quoted(name)}: a KV-cache scale under a name tilekit does not read" for name in
                     files.tensors if name.endswith(KV_SCALE_SUFFIXES) and name not in known]
        if problems:
            raise checkpoints.ModelFileError(files.source, checkpoints.listing("has FP8 KV-cache scales tilekit cannot use", problems))
        plan = {name: checkpoints.Target(files.tensors[name].shape, "float32") for name in known}
        arrays = checkpoints.load_tensors(files, plan, device=checkpoints.HostDevice(), ignore=("",),     # "": every other tensor
                                 expected="its FP8 KV-cache scales", progress=False)
        scales = np.zeros((2, len(layer_names)), np.float32)
        for (which, i), name in found.items():
            value = float(arrays[name].reshape(()))
            problem = kv_scale_problem(value)
            if problem:
                raise checkpoints.ModelFileError(files.source, f"tensor {quoted(name)} {problem}")
            scales[which, i] = value
    return scales[0], scales[1]


# -- quantization math ---------------------------------------------------------------------------------------

def quantize_into(src, codes, scale, kind: str) -> None:
    """Per-output-channel absmax quantization of a float [out, in] array (NumPy or CuPy) into `codes` (int8, or
    FP8 e4m3 bits as uint8) and fp32 `scale` [out], computed in fp32 (on a GPU, FP8 by kernels.quantize_fp8)."""
    xp = array_module(src)
    if kind == "fp8" and xp is np:
        with np.errstate(invalid="ignore", divide="ignore"):     # a non-finite row: refused below
            codes[...], s = quantize_fp8_reference(src)
        scale[...] = s[:, 0]
    elif kind == "fp8":         # the kernel reads whole rows: a row-parallel rank's column slice is copied first
        from tilekit.kernels import quantize_fp8
        quantize_fp8(xp.ascontiguousarray(src), codes, scale.reshape(-1, 1))
    else:
        w = src.astype(xp.float32)
        scale[...] = xp.maximum(xp.abs(w).max(axis=1), xp.float32(MIN_AMAX)) / xp.float32(INT8_MAX)
    if not bool(xp.all(xp.isfinite(scale))):      # a NaN or infinite weight's row has no absmax scale
        raise checkpoints.TensorValueError("holds a value that is not finite: no per-channel scale quantizes its row")
    if kind == "int8":
        codes[...] = xp.clip(xp.rint(w / scale[:, None]), -INT8_MAX, INT8_MAX).astype(xp.int8)


def quantize_weight(w, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """NumPy reference: (codes, fp32 per-channel scales) of a float [out, in] weight."""
    w = np.asarray(w, np.float32)
    codes = np.empty(w.shape, np.int8 if kind == "int8" else np.uint8)
    scale = np.empty(w.shape[0], np.float32)
    quantize_into(w, codes, scale, kind)
    return codes, scale


# -- writing -------------------------------------------------------------------------------------------------

KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def compressed_tensors_config(scheme: Scheme, dequantized: tuple[str, ...] = (), head: bool = False,
                              kv_scales: bool = False) -> dict:
    """The quantization_config save_pretrained writes: compressed-tensors, weights as the model holds them,
    activations dynamic per token; the LM head (unless `head`: quantized) and the modules of `dequantized` (a
    family's DEQUANTIZED patterns, written in the model's dtype) listed unquantized; with `kv_scales`, the
    kv_cache_scheme of static per-tensor FP8 KV-cache scales (the model's, written beside its weights)."""
    weights = {"num_bits": 8, "type": "float" if scheme.weight == "fp8" else "int", "symmetric": True,
               "strategy": scheme.scale, "dynamic": False}
    if scheme.scale == "block":
        weights["block_structure"] = [QBLOCK, QBLOCK]
    return {"quant_method": "compressed-tensors",
            "format": "float-quantized" if scheme.weight == "fp8" else "int-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
            "ignore": ([] if head else ["lm_head"]) + [f"re:.*\\.{p}$" for p in dequantized],
            **({"kv_cache_scheme": dict(KV_CACHE_SCHEME)} if kv_scales else {})}


def file_tensors(state: Mapping, linears: tuple[str, ...], scheme: Scheme) -> tuple[dict, dict]:
    """(tensors under checkpoint names, name -> safetensors dtype of those written as they are) of a quantized
    model's state: codes as I8 / F8_E4M3, scales fp32 ([out, 1] per channel, the grid per block)."""
    tensors, raw = {}, {}
    for name, array in state.items():
        if name.endswith("_scale") and name[:-len("_scale")] in linears:
            tensors[name] = array.reshape(-1, 1) if scheme.scale == "channel" else array
            raw[name] = "F32"
        else:
            tensors[name] = array
            if name in linears:
                raw[name] = FILE_DTYPES[scheme.weight]
    return tensors, raw
