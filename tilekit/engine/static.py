"""Static-batch running of a GPU model: forward() (a CUDA graph per shape) and generate() (a KV cache per (batch,
capacity, pick), each next token chosen on the GPU inside the captured step, graphs of the decode step and of prompt
prefills kept between calls; stop rules, streaming), every argument checked before anything launches."""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from typing import Callable, Sequence

import numpy as np

from tilekit.engine import lifecycle
from tilekit.engine.grammar import constraint_masks, constraints_took, ends_only
from tilekit.engine.graphs import Generation, PrefillGraph
from tilekit.engine.kv_cache import check_kv_cache_dtype
from tilekit.engine.picker import Picker
from tilekit.engine.runner import Runner
from tilekit.engine.sampling import SamplingParams, param_arrays, token_counts
from tilekit.engine.steps import PromptBuffers, capacity_for, forward_hidden, logits
from tilekit.engine.stops import StopChecker
from tilekit.engine.workload import kernel_problems
from tilekit.kernels.next_token import MAX_EOS, pack_params
from tilekit.models.base import Arrays


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

class StaticRunner(Runner):
    """The runner of a GPU model (models.base.CausalLM): forward and generate over static batches (see the module
    doc). It keeps the last max_prefill_graphs forward graphs and max_generations generations (their caches,
    buffers and graphs); forget_graphs() frees them."""

    max_prefill_graphs = 4
    max_generations = 2

    def __init__(self, model):
        super().__init__(model)
        self._graphs: OrderedDict[tuple, PrefillGraph] = OrderedDict()
        self._generations: OrderedDict[tuple, Generation] = OrderedDict()
        self._graphs_lock = threading.Lock()
        lifecycle.track(self)

    def forward(self, ids, *, use_graph: bool = True):
        """Logits (B, T, vocab_size) for token ids (B, T) (host or device integers).

        The first call at a given (B, T) on a stream runs the blocks eagerly and captures them as a
        CUDA graph; later calls replay it (the last max_prefill_graphs shapes are kept) and launch
        only the LM head on its own, into a fresh logits array (a view whose rows are padded, see
        steps.logits). use_graph=False runs every kernel one by one. Graphs hold the configs chosen
        when they were captured: after changing the tuning database or TILEKIT_AUTOTUNE in this
        process, call tilekit.autotune.store.reset() (the ops' launch plans) and forget_graphs().
        """
        import cupy
        ids_host = self.check_ids(ids).astype(np.int32)
        B, T = ids_host.shape
        stream = cupy.cuda.get_current_stream()
        if use_graph:
            out = self._prefill_graph(B, T, stream).run(ids_host, stream)
            if out is not None:           # None: another thread evicted the graph meanwhile
                return out
        buf = PromptBuffers(self.model, B, T, Arrays())
        buf.ids.set(ids_host.reshape(-1))
        forward_hidden(self.model, buf)
        return logits(self.model, buf.acts.h, Arrays()).reshape(B, T, -1)

    def _prefill_graph(self, B: int, T: int, stream) -> PrefillGraph:
        key = (B, T, stream.ptr)
        with self._graphs_lock:
            graph = self._graphs.get(key)
            if graph is None:
                graph = self._graphs[key] = PrefillGraph(self.model, B, T)
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
            gen = Generation(self.model, batch, capacity, picker, kv_cache_dtype)
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

    def release(self) -> None:
        """What lifecycle.release_all calls at exit: every graph and kept generation dropped."""
        self.forget_graphs()

    def generate(self, ids, max_new_tokens: int | None = None, *, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, min_p: float | None = None,
                 repetition_penalty: float | None = None, presence_penalty: float | None = None,
                 frequency_penalty: float | None = None, sampling: Sequence[SamplingParams] | None = None,
                 min_new_tokens: int | None = None, eos_token_id: int | Sequence[int] | None = None,
                 stop_strings: str | Sequence[str] | None = None, seed: int | None = None, use_graph: bool = True,
                 on_token: Callable[[np.ndarray], None] | None = None, kv_cache_dtype: str = "auto",
                 response_format: dict | None = None) -> list[np.ndarray]:
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
        response_format constrains every row's continuation (tilekit.engine.grammar: a JSON schema, any JSON
        object, a regex, a grammar, a choice); a row stops when its constraint is complete. Each step then waits
        for the host, which advances each row's matcher and puts its allowed tokens on the next step's logits.
        """
        check_kv_cache_dtype(kv_cache_dtype)
        prompts = self.check_prompts(ids)
        settings, rows, streams = self.generation_plan(
            prompts, max_new_tokens, sampling, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, min_new_tokens=min_new_tokens, eos_token_ids=eos_token_id,
            stop_strings=stop_strings, seed=seed)
        constraints = self.constraints(response_format, len(prompts))
        B, V, new, eos = len(prompts), self.model.config.vocab_size, settings.max_new_tokens, settings.eos_token_ids
        if len(eos) > MAX_EOS:
            raise ValueError(f"eos_token_id must be at most {MAX_EOS} ids, got {len(eos)}")
        lengths = np.array([len(p) for p in prompts], np.int32)
        if new == 0:
            return [np.asarray(p, np.int64) for p in prompts]
        capacity, T = capacity_for(self.model, int(lengths.max()), new)
        picker = Picker.for_rows(rows, eos, masked=constraints is not None)
        seeds = np.random.SeedSequence(self.shared_seed(settings.seed)).generate_state(B)
        fparams, iparams = pack_params(param_arrays(rows), lengths + settings.min_new_tokens - 1, seeds)
        padded = np.zeros((B, T), np.int32)
        for b, p in enumerate(prompts):
            padded[b, :len(p)] = p
        history = np.zeros((B, capacity + 1), np.int32)
        history[:, :T] = padded
        seen = token_counts(prompts, V).astype(np.int32) if picker.penalties else None
        stops = StopChecker(B, settings)
        watch = on_token is not None or streams is not None or constraints is not None

        with self._generation(B, capacity, picker, kv_cache_dtype) as gen, gen.stream:
            state = gen.state
            gen.start(history, lengths - 1, fparams, iparams, seen)
            if constraints:
                self._put_masks(gen, constraints, stops, iparams, eos, lengths)
            gen.prefill(padded, lengths, use_graph)
            for produced in range(1, new + 1):
                if constraints:        # the next step's forward runs while the host advances the matchers
                    ready = gen.copy_tokens()
                    if produced < new:
                        gen.decode(use_graph, "step_logits")
                    ready.synchronize()
                    tokens = gen.host_tokens.copy()
                elif watch:
                    tokens = state.tokens.get()
                if watch:
                    running = ~stops.done
                    stops.update(tokens, None if streams is None else [s.push(t) for s, t in zip(streams, tokens)])
                    if constraints:
                        constraints_took(constraints, tokens, running, stops)
                    if (running & stops.done).any() and (streams is not None or constraints):
                        gen.set_finished(stops.done)    # a stop string, or a complete grammar: a row with no eos
                    if on_token is not None:
                        on_token(tokens)
                    if stops.all_done:
                        break
                elif produced % 8 == 0 and state.finished.get().all():
                    break
                if produced < new and constraints:
                    self._put_masks(gen, constraints, stops, iparams, eos, lengths)
                    gen.decode(use_graph, "pick")
                elif produced < new:
                    gen.decode(use_graph)
            history = state.history.get()
        if not watch:       # the stop rules over the tokens made (no stop strings here)
            for i in range(new):
                if stops.all_done:
                    break
                stops.update(history[np.arange(B), lengths + i])
        return [history[b, :lengths[b] + stops.lengths[b]].astype(np.int64) for b in range(B)]

    @staticmethod
    def _put_masks(gen, constraints: list, stops, iparams: np.ndarray, eos, lengths: np.ndarray) -> None:
        """The rows' structured-output masks for the next pick (queued on the Generation's stream); a row whose
        grammar allows nothing but its end has its eos ban (min_new_tokens) lifted, so that it can end. The ban
        holds while the pick's position (the row's newest token's) is below iparams[b, 2]: only such rows are asked."""
        masks = constraint_masks(constraints, stops.done, gen.host_bitmask)
        gen.set_bitmask()
        newest = lengths - 1 + stops.lengths
        lift = [b for b in np.flatnonzero(~stops.done) if iparams[b, 2] > newest[b] and ends_only(masks[b], eos)]
        if lift:
            iparams[lift, 2] = 0
            gen.state.iparams.set(iparams, stream=gen.stream)

    def shared_seed(self, seed: int | None) -> int | None:
        """The seed generate() samples with; tensor-parallel and unseeded, rank 0 draws one and the others
        receive it (through an all-reduce), so that every rank samples the same tokens."""
        comm = self.model.comm
        if seed is not None or not comm:
            return seed
        import cupy
        value = int(np.random.SeedSequence().entropy) % (1 << 62) if comm.rank == 0 else 0
        agreed = comm.all_reduce(cupy.asarray(np.array([value], np.int64)))
        return int(cupy.asnumpy(agreed)[0])

    def kernel_problems(self, batch: int, seq_len: int, new_tokens: int | None = None) -> list[tuple]:
        """(op, problem) of every kernel call of forward() or generate(): tilekit.engine.workload.kernel_problems."""
        return kernel_problems(self.model, batch, seq_len, new_tokens)

    def check_ids(self, ids) -> np.ndarray:
        """Host int64 copy of (B, T) ids after checking dtype, shape, range and length."""
        ids = host_ids(ids, "ids")
        if not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"ids must be integers, got dtype {ids.dtype}")
        if ids.ndim != 2 or ids.size == 0:
            raise ValueError(f"ids must be a non-empty 2-D (batch, time) array, got shape {ids.shape}")
        self.check_range(ids, "ids")
        return ids.astype(np.int64)

    def check_prompts(self, ids) -> list[np.ndarray]:
        if isinstance(ids, (list, tuple)) and ids and all(isinstance(p, (list, tuple, np.ndarray)) for p in ids):
            prompts = [np.asarray(p) for p in ids]
            for b, p in enumerate(prompts):
                if p.ndim != 1 or p.size == 0 or not np.issubdtype(p.dtype, np.integer):
                    raise ValueError(f"ids[{b}] must be a non-empty 1-D list of token ids")
                self.check_range(p, f"ids[{b}]")
            return prompts
        return list(self.check_ids(ids))

    def check_range(self, ids: np.ndarray, name: str) -> None:
        if ids.shape[-1] > self.model.context_length:
            raise ValueError(f"{name} has {ids.shape[-1]} positions, more than {self.model.context_limit_message()}")
        if ids.min() < 0 or ids.max() >= self.model.config.vocab_size:
            raise ValueError(f"{name} must lie in [0, {self.model.config.vocab_size}), got values in "
                             f"[{ids.min()}, {ids.max()}]")
