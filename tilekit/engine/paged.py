"""Continuous batching's GPU executor: a scheduler step's forwards over a paged KV cache.

The cache is pools of blocks, one per layer (tilekit.engine.paged_cache: per-head keys and values in the model's
dtype or FP8 codes, or DeepSeek-V2's latent entries), block 0 never handed out (padded rows write there). Each running
request holds a slot (0 .. max_running - 1) for its decode state: its sampling parameters, seed, token counts for
penalties and the next-token kernel's bookkeeping. A step runs up to two forwards: the decode rows (row s: slot s's
newest token; a slot that does not decode is a padded row), each layer's attention one paged decode attention that
also writes their entries, into logits row s; then the prefill chunks flattened (entries written, then attention over
the blocks, per layer), whose final chunks' newest rows go through the final norm and LM head into their slots'
logits rows. next_token then picks every slot's token on the GPU. Decode and prefill rows stay in passes of
their own so that each token is computed as generate() computes it (a model may choose its arithmetic by the rows of
a pass: GPT-2's fixed-point residual stream for small ones, FP8 activations for large ones). Every per-step input
(ids, positions, block tables, write slots, rows, query tiles) goes up in one copy, the picked tokens come back in
another.

Start-up sizes every buffer, runs each shape a step can take once (every kernel compiled and its plan chosen) and
captures the decode-only steps as CUDA graphs for R in powers of two up to max_running, greedy and sampling picks:
serving never compiles or captures. Steps with prefill chunks run eagerly at the prefill sizes warmed up (powers of
two from 64 to the token budget). A step with structured output runs its forward first (a graph of its own when it
only decodes), then the masked pick (token_bitmask, then next_token; a graph too). Its rows' masks are made on a host
thread (tilekit.engine.grammar.fill_masks) from the moment the previous step's tokens were taken (prepare_masks),
during the scheduling and this forward. Tensor-parallel models are refused (one GPU).
"""

from __future__ import annotations

import contextlib

import numpy as np

from tilekit.autotune.arrays import release_scratch
from tilekit.autotune.compile import precompile_launches
from tilekit.autotune.op import collecting_launches
from tilekit.checkpoints.stream import Progress
from tilekit.device import device_info
from tilekit.engine import lifecycle
from tilekit.engine.grammar import ends_only, fill_masks, in_background
from tilekit.engine.graphs import capture
from tilekit.engine.paged_cache import paged_cache
from tilekit.engine.picker import Picker
from tilekit.engine.sampling import param_arrays, token_counts
from tilekit.kernels import next_token, token_bitmask
from tilekit.kernels.next_token import MAX_EOS, MAX_SLOTS, pack_params
from tilekit.kernels.paged_prefill_attention import TILE_ROWS, tile_list
from tilekit.kernels.token_bitmask import words
from tilekit.models.base import Arrays

BLOCKS = (16, 32, 64, 128, 256)      # block sizes the paged kernels take
PREFILL_PAD = 64                    # a step's prefill rows pad to a power of two from this
GREEDY = Picker()
SAMPLING = Picker(penalties=True, slots=MAX_SLOTS, check=True)    # any mix of sampled and penalised rows


def pow2_at_least(n: int, low: int = 1) -> int:
    p = low
    while p < n:
        p *= 2
    return p


NEG_INF_BITS = {"bfloat16": 0xFF80, "float16": 0xFC00, "float32": 0xFF800000}
_MASK_KERNEL = None


def bits(x):
    """x's elements as unsigned integers of their size (copies and masks need no float arithmetic of its dtype)."""
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def mask_tokens(logits, flat_index, dtype: str) -> None:
    """logits.flat[flat_index] = -inf: one elementwise kernel that allocates nothing (it runs inside the captured
    decode step)."""
    global _MASK_KERNEL
    import cupy
    if _MASK_KERNEL is None:
        _MASK_KERNEL = cupy.ElementwiseKernel("int32 at, U pattern", "raw U x", "x[at] = pattern", "tilekit_mask_tokens")
    flat = bits(logits).reshape(-1)
    _MASK_KERNEL(flat_index, flat.dtype.type(NEG_INF_BITS[dtype]), flat)


def zeroed(acts):
    """A pass's activations zeroed once: the attention output of a padded prefill row is never written (no query tile
    lists it), and stays finite."""
    for value in vars(acts).values():
        if hasattr(value, "fill") and hasattr(value, "shape"):
            value.fill(0)
    return acts


class PagedExecutor:
    """Runs scheduler steps of `model` (a GPU CausalLM) over a paged KV cache (see the module doc). num_blocks: the
    pool's blocks (default: gpu_memory_utilization of the memory free once the rest is allocated)."""

    def __init__(self, model, *, max_running: int, token_budget: int, block: int, num_blocks: int | None,
                 gpu_memory_utilization: float, kv_cache_dtype: str, max_len: int, use_graphs: bool = True,
                 compile_workers: int | None = None, compile_timeout_s: float = 300.0, compile_progress=None):
        import cupy
        if model.comm is not None:
            raise ValueError("continuous batching runs one GPU; a tensor-parallel model uses generate()")
        if block not in BLOCKS:
            raise ValueError(f"block must be one of {BLOCKS}, got {block!r}")
        self.cache = paged_cache(model, block, kv_cache_dtype)
        if num_blocks is not None and (not isinstance(num_blocks, int) or num_blocks < 2):
            raise ValueError(f"num_blocks must be an int >= 2, got {num_blocks!r}")
        if compile_workers is not None and (not isinstance(compile_workers, int) or isinstance(compile_workers, bool)
                                            or compile_workers < 1):
            raise ValueError(f"compile_workers must be a positive int, got {compile_workers!r}")
        if isinstance(compile_timeout_s, bool) or not isinstance(compile_timeout_s, (int, float)) \
                or not 0 < compile_timeout_s < float("inf"):
            raise ValueError(f"compile_timeout_s must be a positive number of seconds, got {compile_timeout_s!r}")
        if compile_progress is not None and not callable(compile_progress):
            raise TypeError(f"compile_progress must be callable or None, got {type(compile_progress).__name__}")
        if not (isinstance(gpu_memory_utilization, float) and 0 < gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be a float in (0, 1], got {gpu_memory_utilization!r}")
        self.model, self.block = model, block
        self.S, self.max_len = max_running, max_len
        self.W = -(-max_len // block)                                  # a block table's width
        self.decode_sizes = [1 << i for i in range(max_running.bit_length()) if 1 << i < max_running] + [max_running]
        self.prefill_sizes = []
        p = PREFILL_PAD
        while True:
            self.prefill_sizes.append(p)
            if p >= token_budget:
                break
            p *= 2
        self.n_tiles = -(-self.prefill_sizes[-1] // TILE_ROWS) + max_running
        arrays, S, V, W = Arrays(), max_running, model.config.vocab_size, self.W
        self.stream = cupy.cuda.Stream(non_blocking=True)
        with self.stream:
            self.decode_acts = {n: self.cache.activations(model, n, arrays) for n in self.decode_sizes}
            self.prefill_acts = {p: zeroed(self.cache.activations(model, p, arrays)) for p in self.prefill_sizes}
            N = S + self.prefill_sizes[-1]          # decode rows from 0, prefill rows from S
            sizes = dict(ids=N, positions=N, slots=N, seqs=self.prefill_sizes[-1], lengths=S, newest=S, rows=S,
                         finals=S, eos=MAX_EOS, banned=S * MAX_EOS, dtable=S * W, ptable=S * W,
                         tiles=self.n_tiles * 4)
            self.host = np.zeros(sum(sizes.values()), np.int32)
            self.inputs = arrays.zeros(self.host.shape, "int32")
            self.views, self.host_views, at = {}, {}, 0
            for name, n in sizes.items():
                self.views[name], self.host_views[name] = self.inputs[at:at + n], self.host[at:at + n]
                at += n
            self.dtable = self.views["dtable"].reshape(S, W)
            self.ptable = self.views["ptable"].reshape(S, W)
            self.tiles = self.views["tiles"].reshape(self.n_tiles, 4)
            self.h = arrays.empty((S, model.config.n_embd), model.dtype)
            self.logits_and_sink = arrays.empty((S + 1, V), model.dtype)    # row S: where unused bans go
            self.logits = self.logits_and_sink[:S]
            self.prefill_h = arrays.empty((S, model.config.n_embd), model.dtype)
            self.prefill_logits = arrays.empty((S, V), model.dtype)
            self.bitmask = arrays.zeros((S, words(V)), "int32")      # structured output's allowed tokens
            self.bitmask.fill(-1)
            self.host_bitmask = np.full((S, words(V)), -1, np.int32)
            self._mask_rows: set[int] = set()      # rows of host_bitmask holding a mask (the others all ones)
            self._mask_job = None                  # prepare_masks' work in progress
            self.tokens = arrays.zeros((S,), "int32")
            self.finished = arrays.zeros((S,), "int32")
            self.history = arrays.zeros((S, max_len + 1), "int32")
            self.fparams = arrays.zeros((S, 6), "float32")
            self.iparams = arrays.zeros((S, 4), "int32")
            self.seen = arrays.zeros((S, V), "int32")
            self.out_counts = arrays.zeros((S, V), "int32")
            per_block = self.cache.block_bytes
            if num_blocks is None:
                self.stream.synchronize()
                pool = cupy.get_default_memory_pool()
                free = cupy.cuda.runtime.memGetInfo()[0] + pool.free_bytes()
                num_blocks = min(int(free * gpu_memory_utilization) // per_block, (1 << 31) // block - 1)
                if num_blocks < 2:
                    raise ValueError(f"gpu_memory_utilization {gpu_memory_utilization} of {free >> 20} MiB free "
                                     f"leaves no room for KV blocks of {per_block >> 10} KiB")
            self.num_blocks = num_blocks
            self.cache.allocate(num_blocks, arrays, self.prefill_sizes[-1], W)
        self.slot_of: dict[str, int] = {}
        self.free_slots = list(range(S - 1, -1, -1))
        self.params: dict[str, tuple] = {}          # request id -> (fparams row, iparams row, picker, eos, banned to)
        self.graphs: dict[tuple, object] = {}
        self.use_graphs, self.compile_workers, self.compile_timeout_s = use_graphs, compile_workers, compile_timeout_s
        self.compile_progress = compile_progress
        self.warm = False
        lifecycle.track(self)
        self.warm_up()

    # -- one step -----------------------------------------------------------------------------
    def forget(self, request) -> None:
        """A request finished, was aborted or preempted: its slot is free."""
        slot = self.slot_of.pop(request.id, None)
        if slot is not None:
            self.free_slots.append(slot)
        self.params.pop(request.id, None)

    def launch(self, step, constraints: dict | None = None):
        """Queue one scheduler Step on the GPU and return at once, its handle for collect(). constraints: {request id:
        its structured output's matcher} for the constrained picks, whose masks are put on their logits rows before
        the pick (see prepare_masks). Nothing else is launched before this step is collected."""
        for request in step.preempted:
            self.forget(request)
        for request in step.decodes + [c.request for c in step.chunks]:
            if request.id not in self.slot_of:
                self.slot_of[request.id] = self.free_slots.pop()
        picks = step.picks
        import cupy
        P = sum(c.n for c in step.chunks)
        R = self._size(step.decodes)
        picks_R = self._size(picks)
        with self.stream:
            for request in picks:      # a first pick (a final chunk, or a resumed request's first decode)
                if request.id not in self.params:
                    self._start_slot(request)
            picker = SAMPLING if any(self.params[q.id][2] is SAMPLING for q in picks) else GREEDY
            self._fill_inputs(step)
            self.inputs[...] = cupy.asarray(self.host)
            masked = bool(constraints)
            if not P and not masked and (R, picker) in self.graphs:
                self.graphs[(R, picker)].launch(self.stream)
            else:
                self._forward(R, P, step)             # queued on the GPU: the masks are made meanwhile
                if masked:
                    self._upload_masks(constraints, max(R, picks_R))
                if picks:
                    self._pick_step(picks_R, picker, masked)
        return max(R, picks_R), {q.id: self.slot_of[q.id] for q in picks}

    def collect(self, handle) -> dict:
        """{request id: the token picked} of a launched step's picks, once the GPU has made them (a pick whose request
        was forgotten meanwhile included: the engine drops it)."""
        import cupy
        rows, slots = handle
        with self.stream:
            tokens = cupy.asnumpy(self.tokens[:rows])
        return {request_id: int(tokens[s]) for request_id, s in slots.items()}

    def _forward(self, R: int, P: int, step) -> None:
        """The step's forward passes without the pick: the decode rows (a captured graph when alone), the prefill."""
        if not P and (R, None) in self.graphs:
            self.graphs[(R, None)].launch(self.stream)
            return
        if R:
            self._decode(R, None)
        if P:
            self._prefill(pow2_at_least(P, PREFILL_PAD), any(c.final for c in step.chunks))

    def _pick_step(self, R: int, picker: Picker, masked: bool) -> None:
        """The pick of a step that ran its forward apart: a masked pick's graph, else eagerly."""
        graph = self.graphs.get(("pick", R, picker)) if masked else None
        if graph is not None:
            graph.launch(self.stream)
        else:
            self._pick(R, picker, masked)

    def prepare_masks(self, constraints: dict) -> None:
        """Make the masks of these requests' next picks ({request id: its matcher}) on structured output's host
        thread, once the jobs queued there before (the step's accepts) have run, while the engine schedules and the
        next forward runs; a matcher done by then gets none. The next masked step takes them
        and makes any it lacks (a request new to it, a slot given to another)."""
        rows = self._prepared_rows()
        self._mask_rows |= set(rows.values())
        rows = {request_id: self.slot_of[request_id] for request_id in constraints if request_id in self.slot_of}
        if rows:
            self._mask_job = in_background(self._make_masks, {r: (constraints[r], s) for r, s in rows.items()})

    def _make_masks(self, rows: dict) -> dict:
        """host_bitmask's rows of {request id: (matcher, slot)} whose matchers are not done; their {id: slot}."""
        live = {r: cs for r, cs in rows.items() if not cs[0].done}
        if live:
            fill_masks(list(live.values()), self.host_bitmask)
        return {r: s for r, (_, s) in live.items()}

    def _prepared_rows(self) -> dict:
        """{request id: slot} of the masks prepare_masks made (waiting for them), and none pending after."""
        job, self._mask_job = self._mask_job, None
        return job.result() if job is not None else {}

    def _upload_masks(self, constraints: dict, rows: int) -> None:
        """The bitmask rows the pick reads: each constrained slot's allowed tokens (those prepare_masks made, and the
        rest made now), every other row all ones. A slot whose grammar allows nothing but its end has its eos ban
        (min_new_tokens) lifted, so that it can end."""
        import cupy
        prepared = self._prepared_rows()
        current = {request_id: self.slot_of[request_id] for request_id in constraints}
        for s in (self._mask_rows | set(prepared.values())) - set(current.values()):
            self.host_bitmask[s] = -1
        self._mask_rows = set(current.values())
        missing = [(c, current[request_id]) for request_id, c in constraints.items()
                   if prepared.get(request_id) != current[request_id]]
        if missing:
            fill_masks(missing, self.host_bitmask)
        self.bitmask[:rows] = cupy.asarray(self.host_bitmask[:rows])
        banned, V = self.host_views["banned"], self.model.config.vocab_size
        held = set((banned // V).tolist())                # the slots with banned eos ids (S: the sink row)
        lifted = False
        for request_id in constraints:
            s = self.slot_of[request_id]
            if s in held and ends_only(self.host_bitmask[s], self.params[request_id][3]):
                banned[banned // V == s] = self.S * V     # the sink row
                lifted = True
        if lifted:
            self.views["banned"][...] = cupy.asarray(banned)

    def _size(self, requests) -> int:
        """The decode size (rows 0 .. R-1) that covers these requests' slots; 0 for none."""
        if not requests:
            return 0
        top = max(self.slot_of[q.id] for q in requests)
        return next(r for r in self.decode_sizes if r > top)

    def _start_slot(self, request) -> None:
        """A request's first pick is this step: its slot's sampling parameters, seed and token counts."""
        import cupy
        sp = request.sampling
        fp, ip = pack_params(param_arrays([sp]), [len(request.prompt) + request.min_new_tokens - 1], [request.seed])
        penalties = sp.repetition_penalty != 1 or sp.presence_penalty or sp.frequency_penalty
        picker = GREEDY if sp.greedy and not penalties else SAMPLING
        s = self.slot_of[request.id]
        self.fparams[s] = cupy.asarray(fp[0])
        self.iparams[s] = cupy.asarray(ip[0])
        if penalties:
            V = self.model.config.vocab_size
            self.seen[s] = cupy.asarray(token_counts([request.tokens], V)[0].astype(np.int32))
            self.out_counts[s] = cupy.asarray(token_counts([request.output], V)[0].astype(np.int32))
        self.params[request.id] = (fp, ip, picker, request.eos_token_ids,
                                   len(request.prompt) + request.min_new_tokens - 1)

    def _fill_inputs(self, step) -> None:
        """The host copy of every per-step input (module doc): decode rows from row 0 (by slot), prefill rows from
        row S; each slot's newest position for the pick; the prefill rows whose hidden state each final chunk's
        slot takes (rows) and those slots (finals)."""
        h, B, S = self.host_views, self.block, self.S
        for name in ("ids", "positions", "seqs", "lengths", "newest", "rows", "finals", "tiles", "dtable", "ptable"):
            h[name][:] = 0
        h["slots"][:] = -1
        dtable, ptable = h["dtable"].reshape(S, self.W), h["ptable"].reshape(S, self.W)
        for request in step.decodes:
            s, pos = self.slot_of[request.id], len(request.tokens) - 1
            h["ids"][s], h["positions"][s], h["lengths"][s], h["newest"][s] = request.tokens[-1], pos, pos, pos
            dtable[s, :len(request.blocks)] = request.blocks
        row, lengths, starts = 0, [], []
        for r, chunk in enumerate(step.chunks):
            request, n = chunk.request, chunk.n
            positions = np.arange(chunk.start, chunk.start + n)
            blocks = np.asarray(request.blocks, np.int32)
            at = S + row
            h["ids"][at:at + n] = request.tokens[chunk.start:chunk.start + n]
            h["positions"][at:at + n] = positions
            h["slots"][at:at + n] = blocks[positions // B] * B + positions % B
            h["seqs"][row:row + n] = r
            ptable[r, :len(blocks)] = blocks
            if chunk.final:
                s = self.slot_of[request.id]
                h["rows"][s], h["finals"][s], h["newest"][s] = row + n - 1, 1, len(request.tokens) - 1
            lengths.append(n)
            starts.append(chunk.start)
            row += n
        if step.chunks:
            h["tiles"][:] = tile_list(lengths, starts, capacity=self.n_tiles).reshape(-1)
        # each pick still short of its min_new_tokens has its own eos ids banned in its row (the kernel's eos list,
        # one for every row, stays empty); unused entries point at the sink row
        h["eos"][:] = -1
        V = self.model.config.vocab_size
        h["banned"][:] = S * V                    # flat indices into logits_and_sink
        at = 0
        for request in step.picks:
            _, _, _, ids, banned_below = self.params[request.id]
            if len(request.tokens) - 1 < banned_below:
                h["banned"][at:at + len(ids)] = self.slot_of[request.id] * V + np.asarray(ids)
                at += len(ids)

    def _decode(self, R: int, picker: Picker | None) -> None:
        """The decode forward of rows 0 .. R-1 into logits[:R] and, given a picker, the pick (a captured step)."""
        model, v = self.model, self.views
        x = model.hidden(self.decode_acts[R], v["ids"][:R], v["positions"][:R], self.cache.decode_attend(model, self, R))
        model.final_norm(x, self.h[:R])
        model.lm_head(self.h[:R], out=self.logits[:R])
        if picker is not None:
            self._pick(R, picker)

    def _prefill(self, P: int, head: bool) -> None:
        """The prefill forward of rows S .. S+P-1; with `head`, each final chunk's logits into its slot's row."""
        import cupy
        model, v, S = self.model, self.views, self.S
        x = model.hidden(self.prefill_acts[P], v["ids"][S:S + P], v["positions"][S:S + P], self.cache.prefill_attend(model, self, P))
        if head:
            model.final_norm(x, self.prefill_h, rows=v["rows"])
            model.lm_head(self.prefill_h, out=self.prefill_logits)
            cupy.copyto(bits(self.logits), bits(self.prefill_logits), where=v["finals"][:, None] > 0)

    def _pick(self, R: int, picker: Picker, masked: bool = False) -> None:
        """next_token for slots 0 .. R-1 from logits[:R] (masked: each row's bitmask applied first)."""
        v, pen = self.views, picker.penalties
        if masked:
            token_bitmask(self.logits[:R], self.bitmask[:R])
        self.finished.fill(0)
        mask_tokens(self.logits_and_sink, v["banned"], self.model.dtype)
        next_token(self.logits[:R], self.fparams[:R], self.iparams[:R], v["eos"], self.tokens[:R], v["newest"][:R],
                   self.history[:R], self.finished[:R], seen=self.seen[:R] if pen else None,
                   out_counts=self.out_counts[:R] if pen else None, slots=picker.slots, check=picker.check, pad=0)

    # -- start-up and shutdown ----------------------------------------------------------------
    def warm_up(self) -> None:
        """Every step shape once with padded rows only (kernels compiled, plans chosen), and the decode-only steps
        captured as CUDA graphs. The shapes' kernels are collected first and compiled in parallel processes
        (precompile_launches), so that a cold compile cache costs start-up seconds rather than minutes; a launch not
        compiled there (an error, or still compiling after compile_timeout_s) compiles here as it first runs. Each
        precompiled launch is reported to compile_progress(done, total, name, error), by default a progress bar on a
        terminal. The phases' seconds, the distinct launches and those not precompiled (kernel, config, why) are kept
        in self.startup."""
        import time

        import cupy
        self.host[:] = 0
        self.host_views["slots"][:] = -1
        self.host_views["eos"][:] = -1
        t0 = time.perf_counter()
        with self.stream:
            self.inputs[...] = cupy.asarray(self.host)
            with collecting_launches() as launches:
                self._every_shape(capture_graphs=False)
            self.stream.synchronize()
        t1 = time.perf_counter()
        bar = Progress("tilekit: compiling the engine's kernels", unit="kernels")
        progress = self.compile_progress or (lambda done, total, name, error: bar.update(done, total))
        try:
            count, errors = (precompile_launches(launches, device_info().arch, workers=self.compile_workers,
                                                 timeout_s=self.compile_timeout_s, progress=progress) if launches
                             else (0, {}))
        finally:
            bar.close()
        t2 = time.perf_counter()
        with self.stream:
            self._every_shape(capture_graphs=self.use_graphs)
            self.stream.synchronize()
        self.startup = dict(collect_s=t1 - t0, precompile_s=t2 - t1, run_s=time.perf_counter() - t2,
                            launches=count, precompile_errors=sorted(set(errors.values())))
        self.warm = True

    def _every_shape(self, capture_graphs: bool) -> None:
        for R in self.decode_sizes:         # whole decode steps; and forwards and picks apart, for masked steps
            for picker in (GREEDY, SAMPLING, None):
                self._decode(R, picker)
                if capture_graphs:
                    self.graphs[(R, picker)] = capture(self.stream, lambda: self._decode(R, picker))
            for picker in (GREEDY, SAMPLING):
                self._pick(R, picker, masked=True)
                if capture_graphs:
                    self.graphs[("pick", R, picker)] = capture(self.stream, lambda: self._pick(R, picker, True))
        for p in self.prefill_sizes:
            self._prefill(p, head=True)

    def release(self) -> None:
        """Drop the graphs and the stream's work arrays (what lifecycle.release_all calls at exit)."""
        with contextlib.suppress(Exception):        # masks no step will take (a matcher's error ends nothing here)
            self._prepared_rows()
        self.stream.synchronize()
        self.graphs.clear()
        release_scratch(self.stream.ptr)
