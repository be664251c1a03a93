"""The runtime half of a decoder-only language model on tilekit kernels, shared by every model.

A model class (GPT) holds weights and writes its math as four methods: `activations` (its working
buffers), `hidden` (embeddings and blocks), `final_norm` and `lm_head`. `CausalLM` turns those into
`forward` (a CUDA graph per shape), `generate` (KV cache; each next token, greedy or sampled, chosen
on the GPU inside the captured step by kernels.next_token; graphs of the decode step and of prompt
prefills, kept between calls; stop rules, streaming) and the workload: `kernel_problems` runs the same
step code on MetaArrays and records what each kernel is asked.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Callable, Sequence

import numpy as np

from tilekit import parallel
from tilekit.autotune.arrays import MetaArray, numpy_dtype, release_scratch
from tilekit.autotune.op import recording
from tilekit.kernels import (attention, decode_attention, linear, next_token, quant_linear, quantize_fp8, rms_norm,
                             write_kv)
from tilekit.kernels.next_token import FLOAT_PARAMS, INT_PARAMS, MAX_EOS, candidate_slots, pack_params
from tilekit.kernels.quant_linear import QBLOCK, WEIGHT_DTYPES, dequantize_reference
from tilekit.models.generation import SamplingParams, StopChecker, TextGeneration, param_arrays, token_counts
from tilekit.models import quantization
from tilekit.checkpoints import (CONFIG_NAME, LM_HEAD, Checkpoint, ModelFileError, convert,
                               write_checkpoint)
from tilekit.untrusted import quoted

PAD = 64          # prompts pad to, and KV caches grow in, multiples of this many positions
LOGIT_ROW_ALIGN = 64   # forward()'s logits rows are padded to multiples of this many entries
W8A8_MIN_ROWS = 128    # FP8 weights: from this many rows (prefill) the activations go to FP8 too


class Arrays:
    """Where a model's buffers live: CuPy arrays on the current GPU, or MetaArrays (a dry run)."""

    def __init__(self, meta: bool = False):
        self.meta = meta

    def empty(self, shape, dtype: str):
        if self.meta:
            return MetaArray(shape, dtype)
        import cupy
        return cupy.empty(shape, numpy_dtype(dtype))

    def zeros(self, shape, dtype: str):
        if self.meta:
            return MetaArray(shape, dtype)
        import cupy
        return cupy.zeros(shape, numpy_dtype(dtype))

    def positions(self, batch: int, tokens: int):
        """int32 (batch * tokens,) holding 0..tokens-1 for every sequence."""
        if self.meta:
            return MetaArray((batch * tokens,), "int32")
        import cupy
        return cupy.tile(cupy.arange(tokens, dtype=cupy.int32), batch)


META = Arrays(meta=True)


class FP8Activations:
    """Room for a pass's activations quantized to FP8 (W8A8): codes of `rows` rows of the widest quantized
    linear's input, and `groups` fp32 scales per row (1, or one per 128 columns with block-scaled weights)."""

    def __init__(self, rows: int, widest: int, groups: int, arrays: Arrays):
        self.codes = arrays.empty((rows * widest,), "uint8")
        self.scales = arrays.empty((rows * groups,), "float32")

    def views(self, x, groups: int):
        """Buffers for x (M, K) quantized to FP8: codes (M, K) and scales (M, groups)."""
        M, K = x.shape
        return self.codes[:M * K].reshape(M, K), self.scales[:M * groups].reshape(M, groups)


DTYPES = ("bfloat16", "float16", "float32")       # a model's weights and activations
KV_CACHE_DTYPES = ("auto", "fp8")
# The FP8 cache's scale of every (layer, key/value head), keys and values alike, where the checkpoint gives none
# (CausalLM.kv_scales: a quantized checkpoint's static scale of each layer): 1.0, vLLM's uncalibrated default.
# Values beyond +-448 x scale saturate; magnitudes below 2^-6 x scale (e4m3's smallest normal) keep an absolute step
# of 2^-9 x scale rather than 3 significant bits (README: the accuracy measured). None is computed from the prompt.
FP8_KV_SCALE = 1.0


class KVCache:
    """Keys and values of every layer for B sequences, preallocated to `capacity` positions: in the model's dtype
    ("auto"), or "fp8": e4m3 codes as uint8 with fp32 scales k_scale, v_scale (layers, key/value heads), value =
    code x scale (the checkpoint's scale of each layer, model.kv_scales, else FP8_KV_SCALE), half the bytes a decode
    step reads."""

    def __init__(self, model: "CausalLM", batch: int, capacity: int, arrays: Arrays, dtype: str = "auto"):
        if dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {dtype!r}")
        layers, heads, head_dim = model.cache_dims()
        shape = (layers, batch, heads, capacity, head_dim)
        # zeroed: decode attention multiplies whole key tiles, unwritten slots included, by
        # probabilities that are 0 there, and 0 x NaN from stale memory would be NaN
        codes = "uint8" if dtype == "fp8" else model.dtype
        self.k, self.v = arrays.zeros(shape, codes), arrays.zeros(shape, codes)
        self.k_scale = self.v_scale = None
        if dtype == "fp8":
            self.k_scale, self.v_scale = arrays.zeros((layers, heads), "float32"), arrays.zeros((layers, heads), "float32")
            if not arrays.meta:
                import cupy
                k, v = (np.full(layers, FP8_KV_SCALE),) * 2 if model.kv_scales is None else \
                    quantization.checked_kv_scales(model.kv_scales, layers)
                self.k_scale[...] = cupy.asarray(np.repeat(np.float32(k)[:, None], heads, 1))
                self.v_scale[...] = cupy.asarray(np.repeat(np.float32(v)[:, None], heads, 1))
        self.capacity = capacity

    def scales(self, layer: int) -> dict:
        """The keyword arguments write_kv and decode_attention take for layer's scales (none for a plain cache)."""
        return {} if self.k_scale is None else dict(k_scale=self.k_scale[layer], v_scale=self.v_scale[layer])


class PromptBuffers:
    """Static inputs and activations of one (batch, tokens) prefill: flat ids and positions, the rows
    of each sequence's newest token, KV-cache write offsets (zeros), and the model's activations;
    a Generation keeps its prefill graph here once captured."""

    def __init__(self, model: "CausalLM", batch: int, tokens: int, arrays: Arrays):
        self.shape = (batch, tokens)
        self.ids = arrays.zeros((batch * tokens,), "int32")
        self.positions = arrays.positions(batch, tokens)
        self.last = arrays.zeros((batch,), "int32")
        self.zeros = arrays.zeros((batch,), "int32")
        self.acts = model.activations(batch, tokens, arrays)
        self.graph, self.runs = None, 0


@dataclass(frozen=True)
class Picker:
    """What the captured next-token kernels of a generation are built for (its graphs hold them): token
    counts for penalties, candidate slots for top-k rows, the check pass of top-p rows without top-k, the
    eos ids and the token a finished row emits."""

    penalties: bool = False
    slots: int = 0
    check: bool = False
    eos: tuple[int, ...] = ()
    pad: int = 0

    @classmethod
    def for_rows(cls, rows: Sequence[SamplingParams], eos: Sequence[int]) -> "Picker":
        sampled = [r for r in rows if not r.greedy]
        return cls(penalties=any(r.repetition_penalty != 1 or r.presence_penalty or r.frequency_penalty for r in rows),
                   slots=candidate_slots(r.top_k for r in sampled),
                   check=any(r.top_k == 0 and r.top_p < 1 for r in sampled),
                   eos=tuple(eos), pad=eos[0] if eos else 0)


GREEDY = Picker()
# generate()'s picks as the tuning workload records them: greedy, and Hugging Face's default sampling (top_k 50)
WORKLOAD_PICKERS = (GREEDY, Picker.for_rows([SamplingParams(temperature=1.0, top_k=50)], ()))


class DecodeState:
    """generate()'s device buffers for B sequences of up to `capacity` positions, and the kernels of
    its two steps: a prompt prefill that fills the KV cache, and one decode step, each ending in the
    next-token pick that `picker` describes (per-row parameters in fparams / iparams)."""

    def __init__(self, model: "CausalLM", batch: int, capacity: int, arrays: Arrays, picker: Picker = GREEDY,
                 kv_cache_dtype: str = "auto"):
        self.model, self.batch, self.picker = model, batch, picker
        V = model.config.vocab_size
        self.cache = model.new_cache(batch, capacity, arrays, kv_cache_dtype)
        self.tokens = arrays.zeros((batch,), "int32")
        self.positions = arrays.zeros((batch,), "int32")        # each sequence's newest position
        self.finished = arrays.zeros((batch,), "int32")
        self.history = arrays.zeros((batch, capacity + 1), "int32")
        self.fparams = arrays.zeros((batch, FLOAT_PARAMS), "float32")
        self.iparams = arrays.zeros((batch, INT_PARAMS), "int32")
        self.eos = arrays.zeros((max(1, len(picker.eos)),), "int32")
        self.seen = arrays.zeros((batch, V), "int32") if picker.penalties else None
        self.out_counts = arrays.zeros((batch, V), "int32") if picker.penalties else None
        self.acts = model.activations(batch, 1, arrays)
        self.logits = arrays.empty((batch, V), model.dtype)

    def prefill(self, buf: PromptBuffers, start: int = 0, final: bool = True) -> None:
        """Fill the KV cache from padded prompts (their positions start.. of each sequence: a chunk of a longer
        prompt whose earlier positions are cached, prefill_pieces) and, for the final piece, pick each
        sequence's first new token."""
        if start:
            attend = self.model.prefill_attend(self.cache, buf.zeros + start, past=start)
            x = self.model.hidden(buf.acts, buf.ids, buf.positions + start, attend)
        else:         # a whole prompt: the family's own prefill_attend (DeepSeek-V2's takes no past)
            x = self.model.hidden(buf.acts, buf.ids, buf.positions, self.model.prefill_attend(self.cache, buf.zeros))
        if final:
            self._head(x, buf.last)

    def step(self) -> None:
        """One token for every sequence."""
        attend = self.model.decode_attend(self.cache, self.positions)
        self._head(self.model.hidden(self.acts, self.tokens, self.positions, attend), None)

    def _head(self, x, rows) -> None:
        """Final norm (of `rows` only, when given), logits, and the next-token pick."""
        self.model.final_norm(x, self.acts.h, rows=rows)
        self.model.lm_head(self.acts.h, out=self.logits)
        p = self.picker
        next_token(self.logits, self.fparams, self.iparams, self.eos, self.tokens, self.positions, self.history,
                   self.finished, seen=self.seen, out_counts=self.out_counts, slots=p.slots, check=p.check, pad=p.pad)


def forward_hidden(model: "CausalLM", buf: PromptBuffers) -> None:
    """forward() up to the LM head: the blocks over whole prompts (no KV cache), then the final norm
    into buf.acts.h."""
    x = model.hidden(buf.acts, buf.ids, buf.positions, model.forward_attend())
    model.final_norm(x, buf.acts.h)


def capacity_for(model: "CausalLM", prompt_len: int, new_tokens: int) -> tuple[int, int]:
    """(KV-cache capacity, padded prompt length) of a generate call."""
    capacity = min(model.context_length, -(-(prompt_len + new_tokens) // PAD) * PAD)
    return capacity, min(capacity, -(-prompt_len // PAD) * PAD)


def prefill_pieces(model: "CausalLM", tokens: int, newest: int, cache) -> list[tuple[int, int]]:
    """(start, tokens) of the passes that prefill prompts padded to `tokens`: one, or, past model.prefill_chunk
    tokens with a KVCache in the model's dtype (later chunks attend over the cached keys and values of the earlier
    ones: not FP8 codes, not a latent cache), chunks of prefill_chunk tokens up to the PAD block that holds `newest`
    (the shortest prompt's newest position), then one pass over the rest, which holds every prompt's newest token
    (longer than a chunk only where the prompts' lengths differ by more)."""
    chunk = model.prefill_chunk
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 0 or chunk % PAD:
        raise ValueError(f"prefill_chunk must be 0 (off) or a positive multiple of {PAD}, got {chunk!r}")
    tail = newest // PAD * PAD
    if not chunk or tokens <= chunk or not isinstance(cache, KVCache) or cache.k_scale is not None or not tail:
        return [(0, tokens)]
    return [(s, min(chunk, tail - s)) for s in range(0, tail, chunk)] + [(tail, tokens - tail)]


def _capture(stream, fn) -> object:
    """fn()'s kernels on `stream` recorded as a CUDA graph (nothing runs)."""
    stream.begin_capture()
    try:
        fn()
    except BaseException:
        stream.end_capture()
        raise
    return stream.end_capture()


class Generation:
    """A DecodeState on its own stream, with CUDA graphs of its decode step and of prompt prefills."""

    max_prompt_shapes = 2

    def __init__(self, model: "CausalLM", batch: int, capacity: int, picker: Picker, kv_cache_dtype: str = "auto"):
        import cupy
        self.model, self.batch = model, batch
        self.stream = cupy.cuda.Stream(non_blocking=True)
        with self.stream:
            self.state = DecodeState(model, batch, capacity, Arrays(), picker, kv_cache_dtype)
        self.prompts: OrderedDict[int, PromptBuffers] = OrderedDict()
        self.decode_graph = None
        weakref.finalize(self, release_scratch, self.stream.ptr)   # also when dropped unreleased

    def start(self, history: np.ndarray, positions: np.ndarray, fparams: np.ndarray, iparams: np.ndarray,
              seen: np.ndarray | None) -> None:
        """A new call: the prompts in history, each sequence's newest position, nothing finished, the rows'
        sampling parameters, and with penalties each prompt's token counts."""
        state = self.state
        state.history.set(history)
        state.positions.set(positions)
        state.finished.fill(0)
        state.fparams.set(fparams)
        state.iparams.set(iparams)
        eos = np.full(state.eos.shape, -1, np.int32)
        eos[:len(state.picker.eos)] = state.picker.eos
        state.eos.set(eos)
        if seen is not None:
            state.seen.set(seen)
            state.out_counts.fill(0)

    def prefill(self, ids: np.ndarray, lengths: np.ndarray, use_graph: bool) -> None:
        """Run the prompt prefill of padded prompts ids (B, T) of `lengths` tokens. A prompt length seen twice
        replays a graph; a prompt longer than the model's prefill_chunk runs in chunks (prefill_pieces), eagerly."""
        T = ids.shape[1]
        pieces = prefill_pieces(self.model, T, int(lengths.min()) - 1, self.state.cache)
        if len(pieces) > 1:
            for start, n in pieces:
                self.state.prefill(self._buffers(ids, lengths, start, n), start, final=start + n == T)
            return
        buf = self._buffers(ids, lengths, 0, T)
        if use_graph and buf.graph is not None:
            buf.graph.launch(self.stream)
            return
        self.state.prefill(buf)
        buf.runs += 1
        if use_graph and buf.runs >= 2:        # a prompt shape seen twice: replay it from now on
            buf.graph = _capture(self.stream, lambda: self.state.prefill(buf))

    def _buffers(self, ids: np.ndarray, lengths: np.ndarray, start: int, T: int) -> PromptBuffers:
        """The prompt buffers of T tokens a sequence (the last max_prompt_shapes lengths are kept), holding the
        padded prompts' positions start.. start + T and the rows of each sequence's newest token."""
        buf = self.prompts.pop(T, None)
        if buf is None:
            with self.stream:
                buf = PromptBuffers(self.model, self.batch, T, Arrays())
        self.prompts[T] = buf
        while len(self.prompts) > self.max_prompt_shapes:
            self.prompts.popitem(last=False)
        buf.ids.set(np.ascontiguousarray(ids[:, start:start + T]).reshape(-1))
        buf.last.set(np.arange(len(ids), dtype=np.int32) * T + lengths - 1 - start)
        return buf

    def decode(self, use_graph: bool) -> None:
        """One token for every sequence; the first call runs eagerly and captures the step."""
        if use_graph and self.decode_graph is not None:
            self.decode_graph.launch(self.stream)
            return
        self.state.step()
        if use_graph:
            self.decode_graph = _capture(self.stream, self.state.step)

    def release(self) -> None:
        """Wait for this generation's work, then drop its graphs and its stream's work arrays."""
        self.stream.synchronize()
        self.decode_graph = None
        for buf in self.prompts.values():      # a caller may still hold a buffer: not its graph
            buf.graph = None
        self.prompts.clear()
        release_scratch(self.stream.ptr)


class PrefillGraph:
    """forward() at one (B, T) on one caller stream: static buffers, and the blocks and final norm as
    one CUDA graph, captured on a private stream at the first run."""

    def __init__(self, model: "CausalLM", batch: int, tokens: int):
        import cupy
        self.model, self.shape = model, (batch, tokens)
        self.capture_stream = cupy.cuda.Stream(non_blocking=True)
        with self.capture_stream:
            self.buf = PromptBuffers(model, batch, tokens, Arrays())
        self.graph, self.last_run, self.released = None, None, False
        self.lock = threading.Lock()
        weakref.finalize(self, release_scratch, self.capture_stream.ptr)

    def _capture(self):
        """One eager pass first (compiles kernels, creates their per-stream scratch), then capture."""
        with self.capture_stream:
            forward_hidden(self.model, self.buf)
            return _capture(self.capture_stream, lambda: forward_hidden(self.model, self.buf))

    def run(self, ids: np.ndarray, stream):
        """Logits for host int32 ids of this shape, enqueued on `stream`; None once released."""
        with self.lock:            # ids upload, replay and LM head stay together per caller
            if self.released:
                return None
            if self.graph is None:
                graph = self._capture()
                stream.wait_event(self.capture_stream.record())
                self.graph = graph
            elif self.last_run is not None:      # one handle may name several streams (per-thread
                stream.wait_event(self.last_run)  # default streams): order after the previous run
            with stream:
                self.buf.ids.set(ids.reshape(-1))
                self.graph.launch(stream)
                logits = self.model.logits(self.buf.acts.h, Arrays())
                self.last_run = stream.record()
                return logits.reshape(*self.shape, -1)

    def release(self) -> None:
        """Wait for the last run that reads this graph's buffers, then drop the graph."""
        with self.lock:
            self.released = True
            self.capture_stream.synchronize()
            if self.last_run is not None:
                self.last_run.synchronize()
            self.graph = None
            release_scratch(self.capture_stream.ptr)


_DLPACK_GPU_DEVICES = (2, 3, 13)   # kDLCUDA, kDLCUDAHost, kDLCUDAManaged


def host_ids(x, name: str) -> np.ndarray:
    """NumPy copy of host or device data (NumPy, lists, CuPy, torch on CPU or GPU, any DLPack GPU array)."""
    try:
        if hasattr(x, "__cuda_array_interface__"):
            import cupy
            return cupy.asnumpy(cupy.asarray(x))
        if hasattr(x, "__dlpack_device__") and x.__dlpack_device__()[0] in _DLPACK_GPU_DEVICES:
            import cupy
            return cupy.asnumpy(cupy.from_dlpack(x))
        return np.asarray(x)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} must be an integer array (NumPy, CuPy, torch or nested lists): {e}") from None


class CausalLM(TextGeneration):
    """forward, generate, the workload and checkpoints of a model that provides the math (see the module doc).

    A subclass names its family's `weights` module and `config_class`, sets `config` (with vocab_size,
    block_size and eos_token_id), `dtype`, `meta` (MetaArray weights) and `params` (every weight under its
    Hugging Face name, _init_weights), and implements cache_dims(), activations(), hidden(), final_norm(),
    lm_head() and meta_twin(). The KV cache and the attention calls are the model's too: new_cache() and the
    attend functions that hidden() calls (prefill_attend, decode_attend, forward_attend) default to per-head keys
    and values (KVCache) and tilekit's attention, decode_attention and write_kv; a model with another cache
    (DeepSeek-V2's latent one) overrides all four, and cache_dims() is then unused.
    """

    weights: ModuleType
    config_class: type
    quant: quantization.Scheme | None = None     # quantized linears: how (a subclass that supports it sets it)
    quantized: tuple[str, ...] = ()              # their weights' names (codes; fp32 scales under scale_key(name))
    widest_input: int = 0                        # the widest input (K) of the quantized linears
    parts: dict = {}           # tensor-parallel: name -> (axis, start, stop), the slice of it this rank holds
    vocab: tuple[int, int] = (0, 0)   # tensor-parallel: the vocabulary rows [start, stop) of this rank's LM head
    max_prefill_graphs = 4
    max_generations = 2
    prefill_chunk = 8192       # generate() prefills prompts longer than this in chunks of it (0: never; prefill_pieces)
    comm = None                # tensor-parallel: this rank's tilekit.parallel.Communicator (None: one process)
    shards_quantized = False   # tensor-parallel with quantized linears (a subclass whose sharding supports it)
    kv_scales = None           # a checkpoint's FP8 KV-cache scales: (keys', values') fp32 (layers,), or None (KVCache)

    def _init_runtime(self) -> None:
        self.checkpoint: Checkpoint | None = None
        self._graphs: OrderedDict[tuple, PrefillGraph] = OrderedDict()
        self._generations: OrderedDict[tuple, Generation] = OrderedDict()
        self._graphs_lock = threading.Lock()

    def _init_comm(self, comm, weights_given: bool) -> int:
        """self.comm (None for one rank), self.parts (the family's weights.shard_parts: what this rank holds of each
        tensor) and self.vocab (its LM head's vocabulary rows); refuses seeded weights (`weights_given`: from state=,
        a checkpoint or meta) and, unless the class shards_quantized, quantized linears. Returns this rank (0 for
        one)."""
        world = 1 if comm is None else comm.world_size
        rank = 0 if comm is None else comm.rank
        self.comm = comm if world > 1 else None
        self.parts = self.weights.shard_parts(self.config, rank, world) if self.comm else {}
        if self.comm and self.quant:
            self.check_shards_quantized("quantize, or an FP8 / INT8 checkpoint")
        if self.comm and not weights_given:
            raise ValueError("a tensor-parallel model's weights come from state= or a checkpoint (from_pretrained), "
                             "not from a seed: each rank holds a slice of the same weights")
        self.vocab = parallel.vocab_span(self.config.vocab_size, rank, world)
        if self.comm:       # NCCL lets a communicator go only once no graph holds its collectives: close() drops ours
            self.comm.hold(self.forget_graphs)
        return rank

    @classmethod
    def check_quantized_config(cls, config, scheme: quantization.Scheme | None) -> None:
        """ValueError where `config`'s shapes cannot take `scheme`'s quantized linears (a family's own rules; from a
        checkpoint, from_pretrained names its config.json)."""

    @classmethod
    def loaded_scheme(cls, checkpoint, config, quantize: str | None = None,
                      quantize_head: bool = False) -> quantization.Scheme | None:
        """The quantization a model of `config` loaded from `checkpoint` (a checkpoints.Checkpoint) with `quantize` and
        `quantize_head` holds, its LM head decided (a quantized checkpoint's: where its file stores codes, read from
        the safetensors headers), or None for float linears; the errors from_pretrained raises for it."""
        scheme = quantization.scheme_for(checkpoint, quantize, mixed=bool(getattr(cls.weights, "DEQUANTIZED", ())),
                                         quantize_head=quantize_head)
        quantization.check_head(cls, config, scheme)
        try:
            cls.check_quantized_config(config, scheme)
        except ValueError as e:
            raise ModelFileError(checkpoint.directory / CONFIG_NAME, str(e)) from None
        if scheme is None:
            return None
        if getattr(cls.weights, "QUANTIZED", None) is None:
            raise ValueError(f"{cls.__name__} has no quantized linears ({scheme.source})")
        if scheme.source != quantization.LOAD_TIME:
            name = cls.weights.PREFIX + LM_HEAD
            with checkpoint.tensor_files() as files:
                stored = files.tensors[name].dtype if name in files.tensors else None
            if stored == quantization.FILE_DTYPES[scheme.weight] and scheme.float_head:
                path, key = scheme.float_head
                raise ModelFileError(path, f"field {quoted(key)} lists the LM head unquantized, but the weights "
                                           f"store {quoted(name)} as {stored} codes")
            scheme = replace(scheme, head=stored == quantization.FILE_DTYPES[scheme.weight])
        return replace(scheme, head=quantization.head_quantized(cls.weights, config, scheme))

    @classmethod
    def check_shards_quantized(cls, source: str) -> None:
        """A tensor-parallel model with quantized linears (from `source`) is refused unless the class shards them."""
        if not cls.shards_quantized:
            raise ValueError(f"{cls.__name__}'s tensor parallelism does not take quantized linears yet ({source})")

    def head_weight(self, embedding, untied=None):
        """The LM head's weight: `untied` (a checkpoint's lm_head, this rank's rows when sharded) or, tied, the token
        embedding's rows of this rank's vocabulary."""
        if untied is not None:
            return untied
        return embedding[self.vocab[0]:self.vocab[1]] if self.comm else embedding

    def lm_head(self, h, out=None):
        """Logits h @ self.head^T (tensor-parallel: this rank's vocabulary rows, then vocab_parallel)."""
        if not self.comm:
            return self.head_product(h, out)
        return self.vocab_parallel(h, out, self.head_product)

    def head_product(self, h, out):
        """h @ head^T into out: linear, or quant_linear (weight-only) for a quantized head."""
        if LM_HEAD in self.quantized:
            return quant_linear(h, self.head, self.params[quantization.scale_key(LM_HEAD)],
                                weight_dtype=self.quant.weight, out=out)
        return linear(h, self.head, weight_layout="out_in", out=out)

    def add_partial(self, x, add: Callable[[], None]) -> None:
        """add() adds a layer's output into the fixed-point residual stream x; tensor-parallel, each rank's partial
        output, the other ranks' into zeros so that the residual counts once, then summed (exact in integers)."""
        if self.comm and self.comm.rank and not self.meta:
            x.fill(0)
        add()
        self.sum_ranks(x)

    def shape_only_comm(self):
        """A parallel.ShapeOnly of this rank's place (meta_twin's), or None for one rank."""
        return self.comm and parallel.ShapeOnly(self.comm.rank, self.comm.world_size)

    def sum_ranks(self, x) -> None:
        """A row-parallel projection's partial products summed over the ranks, in place (one rank: nothing)."""
        if self.comm:
            self.comm.all_reduce(x)

    def sum_ranks_then_norm(self, x, weight, eps: float, out) -> None:
        """sum_ranks(x), then out = RMSNorm(x) * weight: one kernel where the communicator fuses them."""
        if not (self.comm and self.comm.all_reduce_norm(x, weight, eps, out)):
            self.sum_ranks(x)
            rms_norm(x, weight, eps, out=out)

    # -- the KV cache and attention ----------------------------------------------------------------
    def new_cache(self, batch: int, capacity: int, arrays: Arrays, dtype: str = "auto"):
        """generate()'s cache for `batch` sequences of up to `capacity` positions, of KV_CACHE_DTYPES `dtype`."""
        return KVCache(self, batch, capacity, arrays, dtype)

    def prefill_attend(self, cache, start, past: int = 0) -> Callable:
        """hidden()'s attend for a prompt prefill: attend(layer, q, k, v, out) writes the keys and values into the
        cache at `start` (int32 (B,) device offsets) and attends causally over the prompts (their own k and v,
        in the model's dtype, whatever the cache holds); with `past` positions of every sequence already cached
        (a chunk of a longer prompt at start = past, prefill_pieces), over the cache's first past + T positions."""
        def attend(i, q, k, v, out):
            write_kv(k, v, cache.k[i], cache.v[i], start, **cache.scales(i))
            if past:
                end = past + q.shape[2]
                attention(q, cache.k[i][:, :, :end], cache.v[i][:, :, :end], causal=True, out=out)
            else:
                attention(q, k, v, causal=True, out=out)
        return attend

    def decode_attend(self, cache, positions) -> Callable:
        """hidden()'s attend for a decode step: writes k and v at `positions` (each sequence's newest), then
        attends over the cache up to them."""
        def attend(i, q, k, v, out):
            decode_attention(q, cache.k[i], cache.v[i], positions, new_k=k, new_v=v, length_offset=1, out=out,
                             **cache.scales(i))
        return attend

    def forward_attend(self) -> Callable:
        """hidden()'s attend for forward(): causal attention over whole prompts, no cache."""
        return lambda i, q, k, v, out: attention(q, k, v, causal=True, out=out)

    # -- quantized linears (tilekit.models.quantization) -----------------------------------------
    def _init_quant(self, quantize, building: bool) -> None:
        """self.quant from a constructor's `quantize` (None, "int8", "fp8" or a checkpoint's Scheme) and
        self.quantized: the weights of the family's QUANTIZED modules. Block scales come from checkpoints only
        (`building`: the model is built empty or meta for one)."""
        if isinstance(quantize, str) or quantize is None:
            if quantize not in (None, *quantization.KINDS):
                raise ValueError(f"quantize must be None, 'int8' or 'fp8', got {quantize!r}")
            quantize = quantize and quantization.Scheme(quantize)
        if quantize and quantize.scale == "block" and not building:
            raise ValueError("block-scaled weights come from a checkpoint (from_pretrained)")
        self.quant = quantize
        if quantize:
            self.quantized = quantization.linear_names(self.weights.state_dict_shapes(self.config),
                                                       self.weights.QUANTIZED)
            if quantization.head_quantized(self.weights, self.config, quantize):
                self.quantized += (LM_HEAD,)

    def _allocate_params(self, groups: Sequence[Sequence[str]], halves: Sequence[Sequence[str]] = ()) -> tuple:
        """self.params: every weight of the family's state_dict_shapes (this rank's slice of those in self.parts),
        uninitialised, under its name, in the
        model's dtype or, for self.quantized, as 8-bit codes with fp32 scales under quantization.scale_key names.
        Each of `groups` (names of weights of one input width, all quantized or none; one GEMM) and of `halves`
        (a quantized SwiGLU's [gate; up], each half with its own block grid) becomes row views of one fused
        matrix, and so do their scales; returns each group's and each halves' (matrix, scales or None)."""
        shapes = {name: parallel.part_shape(shape, self.parts[name]) if name in self.parts else shape
                  for name, shape in self.weights.state_dict_shapes(self.config).items()}
        new, quant = Arrays(self.meta).empty, self.quant
        fused, views = [], {}
        for names, own_grids in [(g, False) for g in groups] + [(h, True) for h in halves]:
            rows, K = [shapes[n][0] for n in names], shapes[names[0]][1]
            coded = quant is not None and names[0] in self.quantized
            matrix = new((sum(rows), K), WEIGHT_DTYPES[quant.weight] if coded else self.dtype)
            scales, per = None, rows
            if coded:
                if quant.scale == "block" and not own_grids and any(r % QBLOCK for r in rows[:-1]):
                    raise ValueError(f"block-scaled {', '.join(names)} need multiples of {QBLOCK} rows to share one "
                                     f"matrix, got {rows}")
                per = rows if quant.scale == "channel" else [-(-r // QBLOCK) for r in rows]
                scales = new((sum(per),) if quant.scale == "channel" else (sum(per), -(-K // QBLOCK)), "float32")
            start = first = 0
            for n, r, b in zip(names, rows, per):
                views[n], start = matrix[start:start + r], start + r
                if coded:
                    views[quantization.scale_key(n)], first = scales[first:first + b], first + b
            fused.append((matrix, scales))
        self.params = {}
        for name, shape in shapes.items():
            if name in views:
                self.params[name] = views[name]
            elif name in self.quantized:
                self.params[name] = new(shape, WEIGHT_DTYPES[quant.weight])
                views[quantization.scale_key(name)] = new(quantization.model_scale_shape(quant.scale, shape),
                                                          "float32")
            else:
                self.params[name] = new(shape, self.dtype)
            if quantization.scale_key(name) in views:
                self.params[quantization.scale_key(name)] = views[quantization.scale_key(name)]
        return fused[:len(groups)], fused[len(groups):]

    def fp8_groups(self, rows: int) -> int:
        """Activation scales per row when `rows` rows run in FP8 (W8A8): 1, or one per 128 columns of the widest
        input with block scales; 0 when they do not (not FP8 weights, or fewer than W8A8_MIN_ROWS rows)."""
        if not self.quant or self.quant.weight != "fp8" or rows < W8A8_MIN_ROWS:
            return 0
        return 1 if self.quant.scale == "channel" else -(-self.widest_input // QBLOCK)

    def fp8_activations(self, rows: int, arrays: Arrays) -> FP8Activations | None:
        """A pass's FP8Activations for `rows` rows, or None when they stay in the model's dtype."""
        groups = self.fp8_groups(rows)
        return FP8Activations(rows, self.widest_input, groups, arrays) if groups else None

    def project(self, fp8: FP8Activations | None, x, w, scale, *, out, residual=None, activation=None):
        """x @ w^T (+ residual) into out: kernels.linear in the model's dtype; quant_linear when quantized, with
        the activations quantized to FP8 into `fp8` (W8A8) for prefill rows of FP8 weights. activation='swiglu'
        (quantized only): w is [gate; up]."""
        if not self.quant:
            return linear(x, w, weight_layout="out_in", residual=residual, out=out)
        x_scale = None
        groups = self.fp8_groups(x.shape[0])
        if groups:
            block = self.quant.scale == "block"
            codes, x_scale = fp8.views(x, -(-x.shape[1] // QBLOCK) if block else 1)
            quantize_fp8(x, codes, x_scale, group=QBLOCK if block else None)
            x = codes
        return quant_linear(x, w, scale, weight_dtype=self.quant.weight, x_scale=x_scale, activation=activation,
                            residual=residual, out=out)

    # -- weights and checkpoints ----------------------------------------------------------------
    def _init_weights(self, state: dict | None, seed: int, empty: bool) -> None:
        """Fill self.params (allocated): from `state` (host arrays under the same names, checked; copied to the
        GPU in their own dtype and converted there), or N(mean, std) drawn on the GPU from `seed` (the family's
        weight_stats), or not at all (empty: from_pretrained streams a checkpoint into them). The quantized
        linears are quantized per channel on the GPU."""
        if state is not None:
            if empty:
                raise ValueError("pass state= or empty=True, not both")
            self.weights.check_state_dict(self.config, state)
        if self.meta or empty:
            return
        import cupy
        rng = cupy.random.default_rng(seed)
        scales = {quantization.scale_key(name) for name in self.quantized}
        for name, out in self.params.items():
            if name in scales:
                continue
            if state is not None:
                part = self.parts.get(name)
                host = state[name] if part is None else parallel.take_part(np.asarray(state[name]), part)
                src = cupy.asarray(np.ascontiguousarray(host))
            else:
                mean, std = self.weights.weight_stats(self.config, name)
                src = rng.standard_normal(out.shape, dtype=cupy.float32) * std + mean
            if name in self.quantized:
                quantization.quantize_into(src.astype(cupy.float32), out, self.params[quantization.scale_key(name)],
                                           self.quant.weight)
            else:
                convert(src, out)

    @classmethod
    def from_pretrained(cls, path_or_name, *, dtype: str = "bfloat16", quantize: str | None = None,
                        quantize_head: bool = False, **kwargs) -> "CausalLM":
        """The model of a Hugging Face checkpoint: a directory (single-file or sharded safetensors), a model name
        in the local hub cache, or a checkpoints.Checkpoint. Its config.json is read field by field; once the
        safetensors headers match the config, the model's device arrays are allocated and the tensors streamed
        into them in `dtype`, never the whole checkpoint on the host. An FP8 / INT8 checkpoint
        (tilekit.models.quantization) loads quantized (its LM head as the file stores it); quantize="int8" | "fp8"
        quantizes a float one per channel as it streams in, with quantize_head=True its untied LM head too (a
        family with weights.QUANTIZED_HEAD); linears the family keeps in its dtype (weights.DEQUANTIZED) are
        dequantized as they load; a quantized checkpoint's static FP8 KV-cache scales (quantization.read_kv_scales)
        become kv_scales, the FP8 KV cache's. kwargs go to the constructor; with a tensor-parallel `comm` among them, only this
        rank's slices of the tensors are read (the family's weights.shard_parts), of a quantized linear its codes
        and their scales (quantization.scale_part), quantize= quantizing the slice. The arguments are checked
        before any file is read."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        quantization.check_arguments(quantize, quantize_head)
        taken = sorted(set(kwargs) & {"state", "empty", "meta", "quantize"})
        if taken:
            raise TypeError(f"from_pretrained sets {', '.join(taken)} itself (the checkpoint's weights, streamed in)")
        if not isinstance(kwargs.get("comm"), (parallel.Communicator, type(None))):
            raise TypeError(f"comm must be a tilekit.parallel.Communicator, got {type(kwargs['comm']).__name__}")
        checkpoint = cls.weights.resolve(path_or_name)
        config = cls.config_class.from_fields(checkpoint.config())
        scheme = cls.loaded_scheme(checkpoint, config, quantize, quantize_head)
        dequantized = getattr(cls.weights, "DEQUANTIZED", ())
        linears = () if scheme is None else quantization.linear_names(cls.weights.state_dict_shapes(config),
                                                                      cls.weights.QUANTIZED)
        comm = kwargs.get("comm")
        parts = None
        if comm is not None and comm.world_size > 1:
            if not hasattr(cls.weights, "shard_parts"):
                raise ValueError(f"{cls.__name__} models have no tensor parallelism")
            if scheme is not None:
                cls.check_shards_quantized(scheme.source)
            parts = cls.weights.shard_parts(config, comm.rank, comm.world_size)
        made = []

        def rewrite(plan, outs, dtypes):
            """The plan with the linears quantized, the LM head too where the scheme holds it quantized."""
            return quantization.rewrite_plan(plan, linears + ((LM_HEAD,) if scheme.head else ()), scheme, outs, dtypes,
                                             dequantized)

        def allocate() -> dict:
            if scheme is not None:
                kwargs["quantize"] = scheme
            made.append(cls(config, dtype=dtype, empty=True, **kwargs))
            return made[0].params
        options = {} if parts is None else {"parts": parts}
        kv_scales = None            # read first: a bad one is refused before the weights stream in
        if scheme is not None and scheme.kv_scales and hasattr(cls.weights, "KV_SCALES"):
            kv_scales = quantization.read_kv_scales(checkpoint, cls.weights.layer_prefixes(config),
                                                    cls.weights.KV_SCALES)
        cls.weights.load(checkpoint, config, dtype=dtype, outs=allocate, ignore=scheme.ignored if scheme else (),
                         rewrite=scheme and rewrite, **options)
        made[0].checkpoint, made[0].kv_scales = checkpoint, kv_scales
        return made[0]

    def state_dict(self) -> dict[str, np.ndarray]:
        """float32 host copies of every weight, under the Hugging Face names (quantized ones dequantized)."""
        import cupy
        if not self.quant:
            return {name: cupy.asnumpy(array).astype(np.float32) for name, array in self.params.items()}
        scales = {quantization.scale_key(name) for name in self.quantized}
        return {name: dequantize_reference(cupy.asnumpy(array), cupy.asnumpy(
                    self.params[quantization.scale_key(name)]), self.quant.weight).astype(np.float32)
                if name in self.quantized else cupy.asnumpy(array).astype(np.float32)
                for name, array in self.params.items() if name not in scales}

    def save_pretrained(self, directory) -> None:
        """Write config.json and model.safetensors in the model's dtype, as Hugging Face's save_pretrained does
        (one tensor at a time through the host); a quantized model's linears as a compressed-tensors checkpoint
        (codes and fp32 scales; the family's layout as its files keep it, weights.LAYOUT.to_file), which
        from_pretrained reads back. A tensor-parallel rank holds slices only: refused."""
        if self.comm:
            raise ValueError("save_pretrained of a tensor-parallel model: each rank holds only its slices of the "
                             "weights; save from a one-rank model (no comm), loaded the same way")
        if not self.quant:
            if self.kv_scales is not None:
                raise ValueError("kv_scales are saved with a quantized model's compressed-tensors checkpoint; this "
                                 "model's linears are not quantized")
            self.weights.save_state_dict(directory, self.config, self.params, dtype=self.dtype)
            return
        tensors, raw = quantization.file_tensors(self.params, self.quantized, self.quant)
        if self.weights.LAYOUT.to_file is not None:
            tensors = self.weights.LAYOUT.to_file(self.config, tensors)
        dequantized = getattr(self.weights, "DEQUANTIZED", ())
        hf_config = dict(self.config.to_hf_dict(), torch_dtype=self.dtype,
                         quantization_config=quantization.compressed_tensors_config(
                             self.quant, dequantized, LM_HEAD in self.quantized, self.kv_scales is not None))
        prefix = self.weights.PREFIX
        tensors, raw = {prefix + n: a for n, a in tensors.items()}, {prefix + n: code for n, code in raw.items()}
        if self.kv_scales is not None:      # compressed-tensors' names (checkpoint names: the prefix is in them)
            if not hasattr(self.weights, "KV_SCALES"):
                raise ValueError(f"kv_scales: {type(self).__name__} checkpoints keep no KV-cache scales")
            layers = self.weights.layer_prefixes(self.config)
            for layer, k, v in zip(layers, *quantization.checked_kv_scales(self.kv_scales, len(layers))):
                for (suffix, *_), value in zip(self.weights.KV_SCALES, (k, v)):
                    tensors[layer + suffix], raw[layer + suffix] = np.float32(value).reshape(()), "F32"
        write_checkpoint(directory, hf_config, tensors, dtype=self.dtype, raw=raw)

    # -- forward --------------------------------------------------------------------------------
    def __call__(self, ids, **kwargs):
        return self.forward(ids, **kwargs)

    def forward(self, ids, *, use_graph: bool = True):
        """Logits (B, T, vocab_size) for token ids (B, T) (host or device integers).

        The first call at a given (B, T) on a stream runs the blocks eagerly and captures them as a
        CUDA graph; later calls replay it (the last max_prefill_graphs shapes are kept) and launch
        only the LM head on its own, into a fresh logits array (a view whose rows are padded, see
        logits()). use_graph=False runs every kernel one by one. Graphs hold the configs chosen
        when they were captured: after changing the tuning database or TILEKIT_AUTOTUNE in this
        process, call tilekit.autotune.store.reset() (the ops' launch plans) and forget_graphs().
        """
        import cupy
        ids_host = self._check_ids(ids).astype(np.int32)
        B, T = ids_host.shape
        stream = cupy.cuda.get_current_stream()
        if use_graph:
            logits = self._prefill_graph(B, T, stream).run(ids_host, stream)
            if logits is not None:           # None: another thread evicted the graph meanwhile
                return logits
        buf = PromptBuffers(self, B, T, Arrays())
        buf.ids.set(ids_host.reshape(-1))
        forward_hidden(self, buf)
        return self.logits(buf.acts.h, Arrays()).reshape(B, T, -1)

    def logits(self, h, arrays: Arrays):
        """The LM head of the rows h into a fresh (rows, vocab_size) array: a view of a buffer whose rows
        are padded to a multiple of LOGIT_ROW_ALIGN entries (scratch), so that an odd vocabulary's rows
        (GPT-2's 50257) start aligned and store faster (the LM head 1.08-1.10x, H200). Tensor-parallel: an
        unpadded array (the all-reduce sums whole buffers)."""
        vocab = self.config.vocab_size
        if self.comm:
            return self.lm_head(h, out=arrays.empty((h.shape[0], vocab), self.dtype))
        padded = arrays.empty((h.shape[0], -(-vocab // LOGIT_ROW_ALIGN) * LOGIT_ROW_ALIGN), self.dtype)
        return self.lm_head(h, out=padded[:, :vocab])

    def _prefill_graph(self, B: int, T: int, stream) -> PrefillGraph:
        key = (B, T, stream.ptr)
        with self._graphs_lock:
            graph = self._graphs.get(key)
            if graph is None:
                graph = self._graphs[key] = PrefillGraph(self, B, T)
                while len(self._graphs) > self.max_prefill_graphs:
                    self._graphs.popitem(last=False)[1].release()
            self._graphs.move_to_end(key)
            return graph

    @contextlib.contextmanager
    def _generation(self, batch: int, capacity: int, picker: Picker, kv_cache_dtype: str = "auto"):
        """A Generation for this call: the kept one for the key if no other call holds it, else a new one.
        It is kept again when the call ends normally and dropped when the call fails."""
        key = (batch, capacity, picker, kv_cache_dtype)
        with self._graphs_lock:
            gen = self._generations.pop(key, None)
        if gen is None:
            gen = Generation(self, batch, capacity, picker, kv_cache_dtype)
        try:
            yield gen
        except BaseException:
            gen.release()
            raise
        with self._graphs_lock:
            if key in self._generations:
                self._generations.pop(key).release()
            self._generations[key] = gen
            while len(self._generations) > self.max_generations:
                self._generations.popitem(last=False)[1].release()

    def forget_graphs(self) -> None:
        """Drop every captured graph and kept generation buffer (the next calls capture anew)."""
        with self._graphs_lock:
            for graph in self._graphs.values():
                graph.release()
            self._graphs.clear()
            for gen in self._generations.values():
                gen.release()
            self._generations.clear()

    # -- generation -----------------------------------------------------------------------------
    def generate(self, ids, max_new_tokens: int | None = None, *, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, min_p: float | None = None,
                 repetition_penalty: float | None = None, presence_penalty: float | None = None,
                 frequency_penalty: float | None = None, sampling: Sequence[SamplingParams] | None = None,
                 min_new_tokens: int | None = None, eos_token_id: int | Sequence[int] | None = None,
                 stop_strings: str | Sequence[str] | None = None, seed: int | None = None, use_graph: bool = True,
                 on_token: Callable[[np.ndarray], None] | None = None, kv_cache_dtype: str = "auto") -> list[np.ndarray]:
        """Continue each prompt by up to `max_new_tokens` tokens with a KV cache.

        ids: a 2-D integer array (B, T) of equal-length prompts, or a list of token lists of different
        lengths. Every argument left None takes the checkpoint's generation_config.json value (see
        generation_defaults(); Hugging Face's precedence: explicit > file > config.json > defaults).
        temperature 0 is greedy; otherwise tokens are sampled from the processed softmax (repetition,
        presence and frequency penalties, temperature, top_k, top_p, min_p, in Hugging Face's order: see
        tilekit.kernels.next_token). `sampling` gives each row its own SamplingParams instead (a list of
        B; not together with the scalar arguments). Each next token is chosen on the GPU inside the
        decode step. A row stops after an eos id (any of eos_token_id / the checkpoint's), once its
        continuation's text contains one of stop_strings (needs the checkpoint's tokenizer), or at
        max_new_tokens; eos ids are banned until min_new_tokens were generated. Rows stop
        independently; the call ends when all have. seed makes sampling repeatable (the same tokens run
        to run, graph or eager). on_token(tokens) is called with the (B,) new tokens of each step
        (finished rows repeat the first eos id). Returns a list of 1-D int arrays (prompt + continuation,
        ending with the token that stopped it).

        The KV cache, buffers and graphs for (batch, capacity, the kind of pick) are kept for the next
        call (the last max_generations of them; forget_graphs() frees them). After its first run the
        decode step is one CUDA graph replay, and so is the prompt prefill once a padded prompt length (a
        multiple of 64) repeats; use_graph=False runs every kernel one by one. kv_cache_dtype "fp8" keeps the
        KV cache as FP8 e4m3 with a static per-head scale (KVCache; a model with another cache refuses it).
        """
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
        prompts = self._check_prompts(ids)
        settings, rows, streams = self.generation_plan(
            prompts, max_new_tokens, sampling, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, min_new_tokens=min_new_tokens, eos_token_ids=eos_token_id,
            stop_strings=stop_strings, seed=seed)
        B, V, new, eos = len(prompts), self.config.vocab_size, settings.max_new_tokens, settings.eos_token_ids
        if len(eos) > MAX_EOS:
            raise ValueError(f"eos_token_id must be at most {MAX_EOS} ids, got {len(eos)}")
        lengths = np.array([len(p) for p in prompts], np.int32)
        if new == 0:
            return [np.asarray(p, np.int64) for p in prompts]
        capacity, T = capacity_for(self, int(lengths.max()), new)
        picker = Picker.for_rows(rows, eos)
        seeds = np.random.SeedSequence(self.shared_seed(settings.seed)).generate_state(B)
        fparams, iparams = pack_params(param_arrays(rows), lengths + settings.min_new_tokens - 1, seeds)
        padded = np.zeros((B, T), np.int32)
        for b, p in enumerate(prompts):
            padded[b, :len(p)] = p
        history = np.zeros((B, capacity + 1), np.int32)
        history[:, :T] = padded
        seen = token_counts(prompts, V).astype(np.int32) if picker.penalties else None
        stops = StopChecker(B, settings)
        watch = on_token is not None or streams is not None

        with self._generation(B, capacity, picker, kv_cache_dtype) as gen, gen.stream:
            state = gen.state
            gen.start(history, lengths - 1, fparams, iparams, seen)
            gen.prefill(padded, lengths, use_graph)
            for produced in range(1, new + 1):
                if watch:
                    tokens = state.tokens.get()
                    running = ~stops.done
                    stops.update(tokens, None if streams is None else [s.push(t) for s, t in zip(streams, tokens)])
                    stopped = np.flatnonzero(running & stops.done)
                    if len(stopped) and streams is not None:   # a stop string ends a row that emits no eos
                        finished = state.finished.get()
                        finished[stopped] = 1
                        state.finished.set(finished)
                    if on_token is not None:
                        on_token(tokens)
                    if stops.all_done:
                        break
                elif produced % 8 == 0 and state.finished.get().all():
                    break
                if produced < new:
                    gen.decode(use_graph)
            history = state.history.get()
        if not watch:       # the stop rules over the tokens made (no stop strings here)
            for i in range(new):
                if stops.all_done:
                    break
                stops.update(history[np.arange(B), lengths + i])
        return [history[b, :lengths[b] + stops.lengths[b]].astype(np.int64) for b in range(B)]

    # -- tensor parallelism ---------------------------------------------------------------------
    def vocab_parallel(self, h, out, project):
        """A vocabulary-sharded LM head: project(h, columns) writes this rank's logits into its columns of out
        (C-contiguous (rows, vocab_size); None: a new array), the other columns are zeroed, and one all-reduce fills
        them in. x + 0 is exact, so every rank then holds the same logits and its next-token kernel picks the same
        token, sampling included, with no broadcast; an all-gather would move half the bytes but land the slices
        rank-major, not as the (rows, V) the pick reads. On the current stream: a captured step holds it."""
        v0, v1 = self.vocab
        if out is None:
            out = Arrays(self.meta).empty((h.shape[0], self.config.vocab_size), self.dtype)
        if not self.meta:           # zero bits are +0 in every float dtype: an integer fill, for any dtype
            bits = out.view(f"u{out.dtype.itemsize}")
            bits[:, :v0] = 0
            bits[:, v1:] = 0
        project(h, out[:, v0:v1])
        return self.comm.all_reduce(out)

    def shared_seed(self, seed: int | None) -> int | None:
        """The seed generate() samples with; tensor-parallel and unseeded, rank 0 draws one and the others
        receive it (through an all-reduce), so that every rank samples the same tokens."""
        if seed is not None or not self.comm:
            return seed
        import cupy
        value = int(np.random.SeedSequence().entropy) % (1 << 62) if self.comm.rank == 0 else 0
        agreed = self.comm.all_reduce(cupy.asarray(np.array([value], np.int64)))
        return int(cupy.asnumpy(agreed)[0])

    # -- the workload ---------------------------------------------------------------------------
    def kernel_problems(self, batch: int, seq_len: int, new_tokens: int | None = None) -> list[tuple]:
        """(op, problem) of every kernel call of forward() on (batch, seq_len) ids, or, with
        new_tokens, of generate() continuing batch prompts of seq_len tokens by new_tokens (its prompt
        prefill and a decode step, greedy and with Hugging Face's default sampling: WORKLOAD_PICKERS): the
        very step code, run on MetaArrays."""
        if not self.meta:
            return self.meta_twin().kernel_problems(batch, seq_len, new_tokens)
        with recording() as calls:
            if new_tokens is None:
                buf = PromptBuffers(self, batch, seq_len, META)
                forward_hidden(self, buf)
                self.logits(buf.acts.h, META)
            else:
                capacity, padded = capacity_for(self, seq_len, new_tokens)
                for picker in WORKLOAD_PICKERS:
                    state = DecodeState(self, batch, capacity, META, picker)
                    for start, n in prefill_pieces(self, padded, seq_len - 1, state.cache):
                        state.prefill(PromptBuffers(self, batch, n, META), start, final=start + n == padded)
                    state.step()
        return calls

    # -- validation -----------------------------------------------------------------------------
    def _check_ids(self, ids) -> np.ndarray:
        """Host int64 copy of (B, T) ids after checking dtype, shape, range and length."""
        ids = host_ids(ids, "ids")
        if not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"ids must be integers, got dtype {ids.dtype}")
        if ids.ndim != 2 or ids.size == 0:
            raise ValueError(f"ids must be a non-empty 2-D (batch, time) array, got shape {ids.shape}")
        self._check_range(ids, "ids")
        return ids.astype(np.int64)

    def _check_prompts(self, ids) -> list[np.ndarray]:
        if isinstance(ids, (list, tuple)) and ids and all(isinstance(p, (list, tuple, np.ndarray)) for p in ids):
            prompts = [np.asarray(p) for p in ids]
            for b, p in enumerate(prompts):
                if p.ndim != 1 or p.size == 0 or not np.issubdtype(p.dtype, np.integer):
                    raise ValueError(f"ids[{b}] must be a non-empty 1-D list of token ids")
                self._check_range(p, f"ids[{b}]")
            return prompts
        return list(self._check_ids(ids))

    def _check_range(self, ids: np.ndarray, name: str) -> None:
        if ids.shape[-1] > self.context_length:
            raise ValueError(f"{name} has {ids.shape[-1]} positions, more than {self.context_limit_message()}")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"{name} must lie in [0, {self.config.vocab_size}), got values in "
                             f"[{ids.min()}, {ids.max()}]")


