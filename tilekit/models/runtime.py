"""The runtime half of a decoder-only language model on tilekit kernels, shared by every model.

A model class (GPT) holds weights and writes its math as four methods: `activations` (its working
buffers), `hidden` (embeddings and blocks), `final_norm` and `lm_head`. `CausalLM` turns those into
`forward` (a CUDA graph per shape), `generate` (KV cache, greedy on the GPU or sampling on the
host, graphs of the decode step and of prompt prefills, kept between calls) and the workload:
`kernel_problems` runs the same step code on MetaArrays and records what each kernel is asked.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import OrderedDict
from typing import Callable

import numpy as np

from tilekit.autotune.arrays import MetaArray, numpy_dtype, release_scratch
from tilekit.autotune.op import recording
from tilekit.kernels import attention, decode_attention, greedy_step, write_kv

PAD = 64          # prompts pad to, and KV caches grow in, multiples of this many positions
LOGIT_ROW_ALIGN = 64   # forward()'s logits rows are padded to multiples of this many entries


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


class KVCache:
    """Keys and values of every layer for B sequences, preallocated to `capacity` positions."""

    def __init__(self, model: "CausalLM", batch: int, capacity: int, arrays: Arrays):
        layers, heads, head_dim = model.cache_dims()
        shape = (layers, batch, heads, capacity, head_dim)
        # zeroed: decode attention multiplies whole key tiles, unwritten slots included, by
        # probabilities that are 0 there, and 0 x NaN from stale memory would be NaN
        self.k, self.v = arrays.zeros(shape, model.dtype), arrays.zeros(shape, model.dtype)
        self.capacity = capacity


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


class DecodeState:
    """generate()'s device buffers for B sequences of up to `capacity` positions, and the kernels of
    its two steps: a prompt prefill that fills the KV cache, and one decode step."""

    def __init__(self, model: "CausalLM", batch: int, capacity: int, arrays: Arrays):
        self.model, self.batch = model, batch
        self.cache = KVCache(model, batch, capacity, arrays)
        self.tokens = arrays.zeros((batch,), "int32")
        self.positions = arrays.zeros((batch,), "int32")        # each sequence's newest position
        self.finished = arrays.zeros((batch,), "int32")
        self.history = arrays.zeros((batch, capacity + 1), "int32")
        self.acts = model.activations(batch, 1, arrays)
        self.logits = arrays.empty((batch, model.config.vocab_size), model.dtype)

    def prefill(self, buf: PromptBuffers, greedy: bool, eos: int) -> None:
        """Fill the KV cache from padded prompts and compute the logits of each newest token."""
        cache = self.cache

        def attend(i, q, k, v, out):
            write_kv(k, v, cache.k[i], cache.v[i], buf.zeros)
            attention(q, k, v, causal=True, out=out)

        self._head(self.model.hidden(buf.acts, buf.ids, buf.positions, attend), buf.last, greedy, eos)

    def step(self, greedy: bool, eos: int) -> None:
        """One token for every sequence."""
        cache = self.cache

        def attend(i, q, k, v, out):      # writes k and v at self.positions, then attends
            decode_attention(q, cache.k[i], cache.v[i], self.positions, new_k=k, new_v=v, length_offset=1, out=out)

        self._head(self.model.hidden(self.acts, self.tokens, self.positions, attend), None, greedy, eos)

    def _head(self, x, rows, greedy: bool, eos: int) -> None:
        """Final norm (of `rows` only, when given), logits, and the greedy pick."""
        self.model.final_norm(x, self.acts.h, rows=rows)
        self.model.lm_head(self.acts.h, out=self.logits)
        if greedy:
            greedy_step(self.logits, self.tokens, self.positions, self.history, self.finished, eos)


def forward_hidden(model: "CausalLM", buf: PromptBuffers) -> None:
    """forward() up to the LM head: the blocks over whole prompts (no KV cache), then the final norm
    into buf.acts.h."""
    x = model.hidden(buf.acts, buf.ids, buf.positions, lambda i, q, k, v, out: attention(q, k, v, causal=True, out=out))
    model.final_norm(x, buf.acts.h)


def capacity_for(model: "CausalLM", prompt_len: int, new_tokens: int) -> tuple[int, int]:
    """(KV-cache capacity, padded prompt length) of a generate call."""
    capacity = min(model.config.block_size, -(-(prompt_len + new_tokens) // PAD) * PAD)
    return capacity, min(capacity, -(-prompt_len // PAD) * PAD)


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

    def __init__(self, model: "CausalLM", batch: int, capacity: int, eos: int, greedy: bool):
        import cupy
        self.model, self.batch, self.eos, self.greedy = model, batch, eos, greedy
        self.stream = cupy.cuda.Stream(non_blocking=True)
        with self.stream:
            self.state = DecodeState(model, batch, capacity, Arrays())
        self.prompts: OrderedDict[int, PromptBuffers] = OrderedDict()
        self.decode_graph = None
        weakref.finalize(self, release_scratch, self.stream.ptr)   # also when dropped unreleased

    def start(self, history: np.ndarray, positions: np.ndarray) -> None:
        """A new call: the prompts in history, each sequence's newest position, nothing finished."""
        self.state.history.set(history)
        self.state.positions.set(positions)
        self.state.finished.fill(0)

    def prefill(self, ids: np.ndarray, last: np.ndarray, use_graph: bool) -> None:
        """Run the prompt prefill of padded prompts ids (B, T); `last` are the rows (of the flattened
        B x T tokens) of each sequence's newest token. A prompt length seen twice replays a graph."""
        T = ids.shape[1]
        buf = self.prompts.pop(T, None)
        if buf is None:
            with self.stream:
                buf = PromptBuffers(self.model, self.batch, T, Arrays())
        self.prompts[T] = buf
        while len(self.prompts) > self.max_prompt_shapes:
            self.prompts.popitem(last=False)
        buf.ids.set(ids.reshape(-1))
        buf.last.set(last)
        if use_graph and buf.graph is not None:
            buf.graph.launch(self.stream)
            return
        self.state.prefill(buf, self.greedy, self.eos)
        buf.runs += 1
        if use_graph and buf.runs >= 2:        # a prompt shape seen twice: replay it from now on
            buf.graph = _capture(self.stream, lambda: self.state.prefill(buf, self.greedy, self.eos))

    def decode(self, use_graph: bool) -> None:
        """One token for every sequence; the first call runs eagerly and captures the step."""
        if use_graph and self.decode_graph is not None:
            self.decode_graph.launch(self.stream)
            return
        self.state.step(self.greedy, self.eos)
        if use_graph:
            self.decode_graph = _capture(self.stream, lambda: self.state.step(self.greedy, self.eos))

    def release(self) -> None:
        """Wait for this generation's work, then drop its graphs and its stream's work arrays."""
        self.stream.synchronize()
        self.decode_graph = None
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


class CausalLM:
    """forward, generate and the workload of a model that provides the math (see the module doc).

    A subclass sets `config` (with vocab_size and block_size), `dtype` and `meta` (MetaArray weights),
    and implements cache_dims(), activations(), hidden(), final_norm(), lm_head(), meta_twin(),
    tokenizer() and eos_token_id().
    """

    max_prefill_graphs = 4
    max_generations = 2

    def _init_runtime(self) -> None:
        self._graphs: OrderedDict[tuple, PrefillGraph] = OrderedDict()
        self._generations: OrderedDict[tuple, Generation] = OrderedDict()
        self._graphs_lock = threading.Lock()

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
        (GPT-2's 50257) start aligned and store faster (the LM head 1.08-1.10x, H200)."""
        vocab = self.config.vocab_size
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
    def _generation(self, batch: int, capacity: int, eos: int, greedy: bool):
        """A Generation for this call: the kept one for the key if no other call holds it, else a new one.
        It is kept again when the call ends normally and dropped when the call fails."""
        key = (batch, capacity, eos, greedy)
        with self._graphs_lock:
            gen = self._generations.pop(key, None)
        if gen is None:
            gen = Generation(self, batch, capacity, eos, greedy)
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
    def generate(self, ids, max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, eos_token_id: int | None = None, seed: int | None = None,
                 use_graph: bool = True, on_token: Callable[[np.ndarray], None] | None = None):
        """Continue each prompt by up to `max_new_tokens` tokens with a KV cache.

        ids: a 2-D integer array (B, T) of equal-length prompts, or a list of token lists of
        different lengths. temperature 0 is greedy (argmax on the GPU); otherwise tokens are sampled
        (with optional top_k / top_p) from the softmax at that temperature on the host. A sequence
        stops after emitting eos_token_id. on_token(tokens) is called with the (B,) new tokens of
        each step. Returns a list of 1-D int arrays (prompt + continuation).

        The KV cache and buffers for (batch, capacity) are kept for the next call (the last
        max_generations of them; forget_graphs() frees them). After its first run the decode step
        is one CUDA graph replay, and so is the prompt prefill once a padded prompt length (a
        multiple of 64) repeats; use_graph=False runs every kernel one by one.
        """
        prompts = self._check_prompts(ids)
        if not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool) \
                or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not temperature >= 0:
            raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
        if top_k is not None and (not isinstance(top_k, (int, np.integer)) or top_k < 1):
            raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
        if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")
        V = self.config.vocab_size
        if eos_token_id is not None and not (isinstance(eos_token_id, (int, np.integer)) and 0 <= eos_token_id < V):
            raise ValueError(f"eos_token_id must be an int in [0, {V}), got {eos_token_id!r}")
        lengths = np.array([len(p) for p in prompts], np.int32)
        need = int(lengths.max()) + max_new_tokens
        if need > self.config.block_size:
            raise ValueError(f"prompt length {int(lengths.max())} + max_new_tokens {max_new_tokens} "
                             f"exceeds block_size {self.config.block_size}")
        if max_new_tokens == 0:
            return [np.asarray(p, np.int64) for p in prompts]
        B = len(prompts)
        capacity, T = capacity_for(self, int(lengths.max()), max_new_tokens)
        greedy = temperature == 0
        eos = -1 if eos_token_id is None else int(eos_token_id)
        rng = np.random.default_rng(seed)
        padded = np.zeros((B, T), np.int32)
        for b, p in enumerate(prompts):
            padded[b, :len(p)] = p
        pos = lengths - 1                      # position of each sequence's newest token
        history = np.zeros((B, capacity + 1), np.int32)
        history[:, :T] = padded
        finished = np.zeros(B, bool)

        def pick_on_host():
            nonlocal pos
            new = sample(state.logits.get().astype(np.float64), temperature, top_k, top_p, rng)
            new = np.where(finished, eos, new).astype(np.int32)
            pos = pos + 1
            history[np.arange(B), pos] = new
            state.tokens.set(new)
            state.positions.set(pos.astype(np.int32))
            return new

        with self._generation(B, capacity, eos, greedy) as gen, gen.stream:
            state = gen.state
            gen.start(history, pos)
            gen.prefill(padded, np.arange(B, dtype=np.int32) * T + pos, use_graph)
            produced = 0
            while True:
                new = None if greedy else pick_on_host()
                produced += 1
                if on_token is not None or produced % 8 == 0 or produced == max_new_tokens:
                    if greedy:
                        new = state.tokens.get()
                        finished |= state.finished.get().astype(bool)
                    if on_token is not None:
                        on_token(new)
                if not greedy and eos_token_id is not None:
                    finished |= new == eos
                if produced == max_new_tokens or finished.all():
                    break
                gen.decode(use_graph)
            gen.stream.synchronize()
            if greedy:
                history = state.history.get()
        out = []
        for b in range(B):
            seq = history[b, :lengths[b] + produced].astype(np.int64)
            hits = np.flatnonzero(seq[lengths[b]:] == eos) if eos_token_id is not None else []
            out.append(seq[:lengths[b] + hits[0] + 1] if len(hits) else seq)
        return out

    def generate_text(self, prompt: str, max_new_tokens: int = 50, *,
                      stream_to: Callable[[str], None] | None = None, **kwargs) -> str:
        """Tokenize `prompt` with the checkpoint's own tokenizer, generate, and decode."""
        tokenizer = self.tokenizer()
        ids = tokenizer.encode(prompt).ids
        if not ids:
            raise ValueError("prompt encodes to no tokens")
        eos = kwargs.pop("eos_token_id", self.eos_token_id(tokenizer))

        def on_token(tokens):
            stream_to(tokenizer.decode([int(tokens[0])]))

        seq = self.generate([ids], max_new_tokens, eos_token_id=eos,
                            on_token=on_token if stream_to is not None else None, **kwargs)[0]
        return tokenizer.decode(seq[len(ids):].tolist())

    # -- the workload ---------------------------------------------------------------------------
    def kernel_problems(self, batch: int, seq_len: int, new_tokens: int | None = None) -> list[tuple]:
        """(op, problem) of every kernel call of forward() on (batch, seq_len) ids, or, with
        new_tokens, of generate() continuing batch prompts of seq_len tokens by new_tokens greedily
        (its prompt prefill and a decode step): the very step code, run on MetaArrays."""
        if not self.meta:
            return self.meta_twin().kernel_problems(batch, seq_len, new_tokens)
        with recording() as calls:
            if new_tokens is None:
                buf = PromptBuffers(self, batch, seq_len, META)
                forward_hidden(self, buf)
                self.logits(buf.acts.h, META)
            else:
                capacity, padded = capacity_for(self, seq_len, new_tokens)
                state = DecodeState(self, batch, capacity, META)
                state.prefill(PromptBuffers(self, batch, padded, META), True, -1)
                state.step(True, -1)
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
        if ids.shape[-1] > self.config.block_size:
            raise ValueError(f"{name} has {ids.shape[-1]} positions, more than block_size {self.config.block_size}")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"{name} must lie in [0, {self.config.vocab_size}), got values in "
                             f"[{ids.min()}, {ids.max()}]")


def sample(logits: np.ndarray, temperature: float, top_k: int | None, top_p: float | None,
           rng: np.random.Generator) -> np.ndarray:
    """One token per row from softmax(logits / temperature), restricted to top_k / nucleus top_p."""
    out = np.empty(logits.shape[0], np.int64)
    for b, row in enumerate(logits):
        z = row / temperature
        if top_k is not None and top_k < z.size:
            kth = np.partition(z, -top_k)[-top_k]
            z = np.where(z < kth, -np.inf, z)
        p = np.exp(z - z.max())
        p /= p.sum()
        if top_p is not None and top_p < 1:
            order = np.argsort(-p)
            keep = np.cumsum(p[order]) - p[order] < top_p
            mask = np.zeros_like(p, bool)
            mask[order[keep]] = True
            p = np.where(mask, p, 0.0)
            p /= p.sum()
        out[b] = rng.choice(p.size, p=p)
    return out
