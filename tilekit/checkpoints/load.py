"""Loading a checkpoint's tensors: the headers checked against a plan before anything is allocated, then every
tensor streamed into its target (tilekit.checkpoints.stream); a model's weights by a family's rules (prefixes, a
tied LM head, pieces kept in another form, the tensor-parallel parts of a rank)."""

from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from tilekit.checkpoints.checkpoint import Checkpoint
from tilekit.checkpoints.files import ModelFileError
from tilekit.checkpoints.plan import Target, check_target, listing, narrowed, tensor_problems
from tilekit.checkpoints.safetensors import DTYPES, FLOATS, TensorFiles
from tilekit.checkpoints.stream import CupyDevice, LoadStream, Progress
from tilekit.parallel.splits import part_shape
from tilekit.untrusted import quoted, shown


def load_tensors(files: TensorFiles, plan: Mapping[str, Target], *, device=None, ignore: tuple[str, ...] = (),
                 expected: str = "the model", buffers: int = 16, buffer_bytes: int = 16 << 20,
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
        check_target(name, target)
        if target.dtype not in device.dtypes:
            raise ValueError(f"plan for {quoted(name)}: {target.dtype} is not a dtype of this device ({device.dtypes})")
    problems = tensor_problems({n: (t.dtype, t.shape) for n, t in files.tensors.items()}, plan, ignore)
    if problems:
        raise ModelFileError(files.source, listing(f"does not match {expected}", problems))
    if buffers < 1 or buffer_bytes < 1:
        raise ValueError(f"buffers and buffer_bytes must be positive, got {buffers} and {buffer_bytes}")
    order = {id(f): i for i, f in enumerate(files.files)}
    jobs = sorted((narrowed(files.tensors[n], plan[n]) for n in plan if n in files.tensors),
                  key=lambda job: (order[id(job[0].file)], job[0].start))
    label = f"loading {shown(files.source.parent, 200)}"
    return LoadStream(jobs, device, buffers, buffer_bytes, Progress(label, progress)).run()


LM_HEAD = "lm_head.weight"
_CODES = {view: code for code, (_, view) in reversed(DTYPES.items())}   # NumPy dtype name -> safetensors dtype


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


def float_dtype(dtype) -> np.dtype:
    """`dtype` as a NumPy dtype, which must be float32 or float64: what host copies of checkpoints load as."""
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise ValueError(f"dtype must be float32 or float64, got {dtype}")
    return dtype
