"""Continuous batching: many requests of any length, arriving at any time, over one paged KV cache.

    engine = LLMEngine(model)                       # a GPU model (PagedExecutor) or a NumPy reference (recompute)
    outputs = engine.generate(["Hello", "The capital of"], max_new_tokens=64, temperature=0)   # offline
    request = engine.add_request("Hi", max_new_tokens=32); engine.step() ...                  # step by step

Each step the scheduler (tilekit.engine.scheduler) plans which requests run and how many tokens each, the executor
runs them in one forward and picks each next token on the GPU, and the engine applies every stop rule of
generate() (eos ids, stop strings over the decoded text, max_new_tokens; eos banned before min_new_tokens) and
streams each request's text as it is made, the text of one step decoded while the GPU runs the next (step()). A
request's tokens depend on its own prompt, parameters and seed only, not on what it was batched with. AsyncEngine
runs the step loop in a thread of its own for the server.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from tilekit.engine.blocks import BlockPool
from tilekit.engine.grammar import Constraint, accept_tokens, in_background
from tilekit.engine.sampling import GenerationSettings
from tilekit.engine.scheduler import Request, Scheduler
from tilekit.engine.stops import StopChecker
from tilekit.engine.text import TextStream
from tilekit.kernels.next_token import MAX_EOS

_ids = itertools.count()


@dataclass
class Output:
    """What one step made of one request: its new tokens and text, and whether it finished (and why: "stop" for an
    eos id or a stop string, "length" for max_new_tokens or the context, "abort")."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def then(self, later: "Output") -> "Output":
        """This output and the same request's next one as one (a consumer that fell behind takes them together)."""
        return Output(self.request_id, self.token_ids + later.token_ids, self.text + later.text, later.finished,
                      later.finish_reason, later.prompt_tokens, later.completion_tokens, later.cached_tokens)


@dataclass
class _Track:
    """The engine's view of a running request: its stop rules, its text stream, the text held back while a stop
    string may still be completing, and when it arrived and made its first token (metrics)."""

    request: Request
    stops: StopChecker
    stream: TextStream | None
    hold: int
    arrived: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    pending: str = ""
    sent: str = ""


class LLMEngine:
    """A model served by continuous batching (see the module doc). max_running: requests running at once (the
    executor's slots); token_budget: tokens a step computes; block: positions a KV-cache block holds; num_blocks
    (default: what gpu_memory_utilization of the GPU's free memory holds); max_len: a request's prompt +
    max_new_tokens (default the model's context); chunk: a prefill chunk's tokens (0: the budget's rest);
    compile_workers: processes that compile the start-up's kernels on a cold cache (default: the cores less one;
    engines starting side by side should share the cores between them); compile_timeout_s: how long they may take
    (the launches still compiling then are compiled as they first run); compile_progress(done, total, name, error):
    called as each of those compiles ends (default: a progress bar on a terminal)."""

    def __init__(self, model, *, max_running: int = 64, token_budget: int = 2048, block: int = 64,
                 num_blocks: int | None = None, gpu_memory_utilization: float = 0.9, kv_cache_dtype: str = "auto",
                 prefix_caching: bool = True, max_len: int | None = None, chunk: int = 0, use_graphs: bool = True,
                 compile_workers: int | None = None, compile_timeout_s: float = 300.0, compile_progress=None):
        from tilekit.models.reference import ReferenceLM
        self.model = model
        self.runner = model.runner
        self.max_len = model.context_length if max_len is None else max_len
        if not isinstance(self.max_len, int) or not 1 <= self.max_len <= model.context_length:
            raise ValueError(f"max_len must be an int in [1, {model.context_length}] ({model.context_limit_message()}),"
                             f" got {max_len!r}")
        if isinstance(model, ReferenceLM):
            from tilekit.engine.recompute import RecomputeExecutor
            self.executor = RecomputeExecutor(model)
            num_blocks = num_blocks or max_running * -(-self.max_len // block) + 1
        else:
            from tilekit.engine.paged import PagedExecutor
            self.executor = PagedExecutor(model, max_running=max_running, token_budget=token_budget, block=block,
                                          num_blocks=num_blocks, gpu_memory_utilization=gpu_memory_utilization,
                                          kv_cache_dtype=kv_cache_dtype, max_len=self.max_len, use_graphs=use_graphs,
                                          compile_workers=compile_workers, compile_timeout_s=compile_timeout_s,
                                          compile_progress=compile_progress)
            num_blocks = self.executor.num_blocks
        self.pool = BlockPool(num_blocks, block, prefix_caching)
        self.scheduler = Scheduler(self.pool, max_running=max_running, token_budget=token_budget,
                                   max_len=self.max_len, chunk=chunk)
        self.tracks: dict[str, _Track] = {}
        self._inflight = None          # (Step, the executor's handle) launched and not yet collected
        self.defaults: GenerationSettings = self.runner.generation_defaults()
        self.counters = dict(prompt_tokens=0, generation_tokens=0, finished=0, preemptions=0)

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int], max_new_tokens: int | None = None, *,
                    request_id: str | None = None, ignore_eos: bool = False, stop_token_ids: Sequence[int] = (),
                    response_format: dict | Constraint | None = None, **options) -> Request:
        """Queue one request: `prompt` text (the checkpoint's tokenizer encodes it) or token ids; options as for
        generate() (temperature, top_k, top_p, min_p, repetition / presence / frequency penalties, min_new_tokens,
        eos_token_id, stop_strings, seed), the checkpoint's generation_config.json filling in the rest;
        stop_token_ids stop it too, and ignore_eos lets it run past the eos ids; response_format constrains its
        output (tilekit.engine.grammar: a JSON schema, any JSON object, a regex, a grammar, a choice; or a Constraint
        built from one by Runner.constraint, off the engine's thread) and it stops when that is complete (a matcher
        that fails ends it with "abort"). Every argument is checked here."""
        ids = self.runner._encoded(prompt) if isinstance(prompt, str) else list(prompt)
        V = self.model.config.vocab_size
        if not ids or not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) and 0 <= t < V
                              for t in ids):
            raise ValueError(f"prompt must be text or a non-empty list of token ids in [0, {V})")
        ids = [int(t) for t in ids]
        if "eos_token_id" in options:
            options["eos_token_ids"] = options.pop("eos_token_id")
        settings = self.defaults.override(max_new_tokens=max_new_tokens, **options)
        if settings.max_new_tokens is None:
            raise ValueError("max_new_tokens must be given (the checkpoint's generation_config.json sets none)")
        extra = tuple(dict.fromkeys(int(t) for t in stop_token_ids))
        if any(not 0 <= t < V for t in (*settings.eos_token_ids, *extra)):
            raise ValueError(f"eos_token_id and stop_token_ids must lie in [0, {V})")
        eos = extra if ignore_eos else tuple(dict.fromkeys(settings.eos_token_ids + extra))
        if len(eos) > MAX_EOS:
            raise ValueError(f"eos_token_id and stop_token_ids must be at most {MAX_EOS} ids together, got {len(eos)}")
        seed = settings.seed if settings.seed is not None else int(np.random.SeedSequence().entropy % (1 << 31))
        constraint = response_format if isinstance(response_format, Constraint) else \
            self.runner.constraint(response_format)
        request = Request(ids, settings.max_new_tokens, settings.sampling, min_new_tokens=settings.min_new_tokens,
                          eos_token_ids=eos, stop_strings=settings.stop_strings, seed=seed,
                          id=request_id or f"req-{next(_ids)}", constraint=constraint)
        if request.id in self.tracks:
            raise ValueError(f"request id {request.id!r} is already running")
        if constraint is not None and any(t.request.constraint is constraint for t in self.tracks.values()):
            raise ValueError("response_format: this Constraint already constrains a running request (one matcher "
                             "a request: Constraint.copy() makes another)")
        if settings.max_new_tokens == 0:
            raise ValueError("max_new_tokens must be at least 1")
        stream = self._text_stream(ids)
        if settings.stop_strings and stream is None:
            raise ValueError("stop_strings need the checkpoint's tokenizer")
        self.scheduler.add(request)
        stop_settings = GenerationSettings(max_new_tokens=settings.max_new_tokens, eos_token_ids=eos,
                                           stop_strings=settings.stop_strings)
        hold = max(map(len, settings.stop_strings), default=1) - 1
        self.tracks[request.id] = _Track(request, StopChecker(1, stop_settings), stream, hold)
        return request

    def _text_stream(self, ids: list[int]) -> TextStream | None:
        """A request's incremental detokenizer, or None for a model without a checkpoint tokenizer (ids only)."""
        if not self.runner.has_tokenizer():
            return None
        return TextStream(self.runner.tokenizer(), context=ids, source=self.runner._tokenizer_file())

    def abort(self, request_id: str) -> bool:
        """Stop a request now (its blocks go back); False when it is not running or waiting."""
        track = self.tracks.pop(request_id, None)
        if track is None:
            return False
        self.scheduler.finish(track.request, "abort")
        self.executor.forget(track.request)
        return True

    @property
    def has_unfinished(self) -> bool:
        """Requests running or waiting (a launched step whose requests have all ended needs no more steps: the next
        step() collects and drops it)."""
        return self.scheduler.unfinished > 0

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> list[Output]:
        """One step of every running request; the outputs of those that made a token or finished.

        The step is pipelined: it collects the tokens of the step launched last, ends the requests those tokens end
        by eos, length or grammar, launches the next step, and only then, while the GPU runs it, decodes the collected
        tokens' text and applies the stop strings (a request a stop string ends was launched once more: that pick is
        dropped). So a call returns the outputs of the step before the one it launches."""
        emits = self._collect() if self._inflight is not None else []
        step = self.scheduler.schedule()
        self.counters["preemptions"] += len(step.preempted)
        if step.decodes or step.chunks:
            constraints = {q.id: q.constraint for q in step.picks if q.constraint is not None}
            self._inflight = (step, self.executor.launch(step, constraints))
        elif self.scheduler.unfinished and not step.preempted and not emits:       # never a silent hang
            raise RuntimeError(f"the scheduler planned nothing with {len(self.scheduler.running)} running and "
                               f"{len(self.scheduler.waiting)} waiting requests ({self.pool.free} free blocks)")
        return [self._took(q, token, self._text(q, token), accepted) for q, token, accepted in emits]

    def _collect(self) -> list[tuple]:
        """The launched step's picks taken: the scheduler advanced, structured output's matchers advanced (and the
        next masks started), and each request that its token ends by eos, length or its grammar finished, so that it
        is not scheduled again. Returns (request, token, the matcher's (accepted, done) or None) for each pick of a
        request still tracked (not aborted, nor ended by a stop string meanwhile)."""
        step, handle = self._inflight
        self._inflight = None
        picked = self.executor.collect(handle)
        took = [q for q in step.picks if q.id in picked and q.id in self.tracks]
        self.scheduler.advance(step, {q.id: picked[q.id] for q in took})
        self.counters["prompt_tokens"] += sum(c.n for c in step.chunks)
        constrained = [q for q in took if q.constraint is not None]
        accepted = {}
        if constrained:         # on the host thread: the accepts, then the next step's masks (the matchers are
            pairs = [(q.constraint, int(picked[q.id])) for q in constrained]    # touched there alone meanwhile)
            accepting = in_background(lambda: [(ok, c.done) for (c, _), ok in zip(pairs, accept_tokens(pairs))])
            self.executor.prepare_masks({q.id: q.constraint for q in constrained})
            accepted = dict(zip((q.id for q in constrained), accepting.result()))
        for q in took:
            ok, done = accepted.get(q.id, (True, False))
            if self.tracks[q.id].stops.ends(0, picked[q.id]) or not ok or done:
                self.scheduler.finish(q, None)             # its reason is given once its text is done (_took)
                self.executor.forget(q)
        return [(q, int(picked[q.id]), accepted.get(q.id)) for q in took]

    def _text(self, request: Request, token: int) -> str:
        """The text a request's new token prints ("" without a stream)."""
        stream = self.tracks[request.id].stream
        return stream.push(token) if stream is not None else ""

    def _took(self, request: Request, token: int, piece: str, accepted: tuple[bool, bool] | None) -> Output:
        """A request's new token, which printed `piece`; `accepted`: whether its structured output's matcher took it,
        and whether the matcher is then done (None: it has none)."""
        track = self.tracks[request.id]
        if track.first_token is None:
            track.first_token = time.monotonic()
        self.counters["generation_tokens"] += 1
        stopped = track.stops.took(0, token, piece)
        text = track.pending + piece
        complete = refused = False
        if accepted is not None:              # a matcher that refuses the token ends this request alone
            refused, complete = not accepted[0], accepted[1]
        finished = stopped or complete or refused
        reason = None
        if finished:
            if track.stream is not None:
                text += track.stream.flush()
            full = track.sent + text
            hit = [full.find(s, max(0, len(track.sent) - len(s))) for s in request.stop_strings]
            hit = [i for i in hit if i >= 0]
            if hit:                                   # the stop string and what follows it are not returned
                text = full[:min(hit)][len(track.sent):] if min(hit) >= len(track.sent) else ""
            reason = "abort" if refused else "stop" if (hit or complete or token in request.eos_token_ids) \
                else "length"
            self.scheduler.finish(request, reason)
            self.executor.forget(request)
            self.tracks.pop(request.id)
            self.counters["finished"] += 1
            track.pending = ""
        elif track.hold:                             # text a stop string may still complete is held back
            keep = min(track.hold, len(text))
            text, track.pending = text[:len(text) - keep], text[len(text) - keep:]
        track.sent += text
        return Output(request.id, [token], text, finished, reason, len(request.prompt), len(request.output),
                      request.cached_tokens)

    def generate(self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int | None = None, *,
                 sampling: Sequence[dict] | None = None, **options) -> list[dict]:
        """Offline: every prompt (text or ids) through the engine together, each with `options` updated by its own
        dict in `sampling` (max_new_tokens included); returns, in the prompts' order, {"token_ids", "text", "finish_reason",
        "cached_tokens"} of each continuation."""
        if self.has_unfinished:
            raise RuntimeError("generate() runs the engine until its own prompts finish; requests added with "
                               "add_request() are still running (step() them, or abort them)")
        if sampling is not None and len(sampling) != len(prompts):
            raise ValueError(f"sampling must give one dict of options per prompt ({len(prompts)}), got {len(sampling)}")
        requests = []
        for p, own in zip(prompts, sampling or [{}] * len(prompts)):
            merged = {**options, **own}
            requests.append(self.add_request(p, merged.pop("max_new_tokens", max_new_tokens), **merged))
        texts = {r.id: [] for r in requests}
        done = {}
        while len(done) < len(requests):
            for out in self.step():
                texts[out.request_id].append(out.text)
                if out.finished:
                    done[out.request_id] = out
            if not self.has_unfinished and len(done) < len(requests):
                raise RuntimeError("the engine stopped with requests unfinished")
        return [{"token_ids": r.output, "text": "".join(texts[r.id]), "finish_reason": done[r.id].finish_reason,
                 "cached_tokens": r.cached_tokens} for r in requests]

    def stats(self) -> dict:
        """What the server's metrics report: running and waiting requests, KV blocks used and their total, the
        prefix cache's hit rate, and the token and preemption counters."""
        return dict(running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                    blocks_used=self.pool.used, blocks_total=self.pool.num_blocks - 1,
                    prefix_hit_rate=self.pool.hit_rate, **self.counters)

    def close(self) -> None:
        """Abort every request and release what the executor captured."""
        for request_id in list(self.tracks):
            self.abort(request_id)
        self._inflight = None
        self.executor.release()


_NOTHING = object()


def _put_each(items: list) -> None:
    for queue, item in items:
        queue.put_nowait(item)


class AsyncEngine:
    """An LLMEngine stepped by a thread of its own, for a server's event loop: submit() queues a request and yields
    its Outputs as they are made, those made while the consumer was busy as one (the request is aborted when the
    consumer stops listening: a client that went away); the loop never waits on the GPU, the engine never waits on
    the loop, which it wakes once a step with every output of that step."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.lock = threading.Condition()
        self.inbox: list[tuple] = []          # ("add", args, kwargs, listener) | ("abort", id)
        self.listeners: dict[str, tuple] = {}  # request id -> (event loop, asyncio.Queue)
        self.stopping = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="tilekit-engine", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        engine = self.engine
        try:
            while True:
                with self.lock:
                    while not self.inbox and not engine.has_unfinished and not self.stopping:
                        self.lock.wait()
                    if self.stopping and not self.inbox and not engine.has_unfinished:
                        break
                    inbox, self.inbox = self.inbox, []
                for item in inbox:
                    if item[0] == "add":
                        _, args, kwargs, listener = item
                        try:
                            request = engine.add_request(*args, **kwargs)
                        except (ValueError, TypeError) as e:
                            self._send(listener, e)
                            continue
                        self.listeners[request.id] = listener
                        self._send(listener, request)
                    else:
                        if engine.abort(item[1]):
                            listener = self.listeners.pop(item[1], None)
                            if listener is not None:
                                self._send(listener, None)
                if engine.has_unfinished:
                    made: dict = {}             # event loop -> [(queue, output)]: one wake-up of each loop a step
                    for out in engine.step():
                        listener = self.listeners.get(out.request_id)
                        if listener is not None:
                            made.setdefault(listener[0], []).append((listener[1], out))
                            if out.finished:
                                self.listeners.pop(out.request_id)
                    for loop, items in made.items():
                        self._deliver(loop, items)
        except BaseException as e:      # noqa: BLE001 - reported to every waiting request, then to shutdown()
            with self.lock:
                self.error = e
                inbox, self.inbox = self.inbox, []
            for listener in self.listeners.values():
                self._send(listener, e)
            self.listeners.clear()
            for item in inbox:               # adds nobody will take now
                if item[0] == "add":
                    self._send(item[3], RuntimeError(f"the engine failed: {e}"))
        finally:
            for request_id in list(engine.tracks):
                engine.abort(request_id)
            for listener in self.listeners.values():
                self._send(listener, None)

    @classmethod
    def _send(cls, listener, item) -> None:
        loop, queue = listener
        cls._deliver(loop, [(queue, item)])

    @staticmethod
    def _deliver(loop, items: list) -> None:
        """Each (queue, item) put on its queue, by one callback on the loop that owns them."""
        try:
            loop.call_soon_threadsafe(_put_each, items)
        except RuntimeError:            # the loop has closed: nobody is listening
            pass

    async def submit(self, *args, **kwargs):
        """Queue a request (add_request's arguments); an async iterator of its Outputs, the last one finished. A
        ValueError from add_request is raised here, before the first output."""
        return await self.started(self.enqueue(*args, **kwargs))

    def enqueue(self, *args, **kwargs) -> asyncio.Queue:
        """Queue a request now (it counts in queue_depth on return); await started() on what this returns."""
        queue: asyncio.Queue = asyncio.Queue()
        listener = (asyncio.get_running_loop(), queue)
        with self.lock:
            if self.error is not None:
                raise RuntimeError(f"the engine failed: {self.error}")
            if self.stopping or not self.thread.is_alive():
                raise RuntimeError("the engine is shutting down")
            self.inbox.append(("add", args, kwargs, listener))
            self.lock.notify()
        return queue

    async def started(self, queue: asyncio.Queue):
        """(its first Output, an async iterator of the rest) of an enqueued request."""
        first = await queue.get()
        if isinstance(first, BaseException):
            raise first
        return first, self._outputs(first.id, queue)

    async def _outputs(self, request_id: str, queue: asyncio.Queue):
        """The request's Outputs; those that arrived while the consumer was busy come as one (Output.then)."""
        finished, held = False, _NOTHING
        try:
            while True:
                item, held = (await queue.get() if held is _NOTHING else held), _NOTHING
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise RuntimeError(f"the engine failed: {item}") from item
                while not item.finished and not queue.empty():
                    later = queue.get_nowait()
                    if not isinstance(later, Output):       # an abort or an error: after what came before it
                        held = later
                        break
                    item = item.then(later)
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self.lock:
            self.inbox.append(("abort", request_id))
            self.lock.notify()

    def stats(self) -> dict:
        return self.engine.stats()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop admitting, let the running requests finish (or abort them after `timeout` seconds), stop the thread
        and release the engine."""
        with self.lock:
            self.stopping = True
            self.lock.notify()
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.thread.is_alive() and self.engine.has_unfinished:
            if deadline is not None and time.monotonic() > deadline:
                for request_id in list(self.engine.tracks):
                    self.abort(request_id)
                break
            time.sleep(0.01)
        self.thread.join(timeout=30)
        self.engine.executor.release()

    @property
    def queue_depth(self) -> int:
        return len(self.engine.scheduler.waiting) + len(self.inbox)

