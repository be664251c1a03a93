"""Continuous batching's scheduler: which requests run in the next step, and how many of their tokens.

Each step has a token budget. The running requests that decode come first, one token each (in the order they were
admitted); a request whose next position needs a new block takes one, and when none is free the most recently
admitted running request is preempted (and so for a prefilling request that finds no block for its next chunk): its
blocks go back and it returns to the front of the waiting queue, to be recomputed from its tokens when it runs again (its output is unchanged: greedy picks are, and sampled ones come from
noise keyed by its seed and the position). Then the requests still prefilling, then the waiting ones in arrival
order (first come, first served: a request that cannot start holds back those behind it, so none starves), each
taking the budget's rest in a chunk of its prompt. A request starting looks its prompt's full blocks up in the
prefix cache (BlockPool) and computes only what follows the cached prefix (at least its last token, whose logits
pick the first new token).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from tilekit.engine.blocks import BlockPool, block_hashes
from tilekit.engine.sampling import SamplingParams

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"
_ids = itertools.count()


@dataclass
class Request:
    """One request: its prompt, what it asks for, and where it stands. `tokens` is prompt + output; `computed`
    counts the leading tokens whose keys and values are in the cache."""

    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    min_new_tokens: int = 0
    eos_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int = 0
    id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    status: str = WAITING
    tokens: list[int] = field(default_factory=list)
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    cached_tokens: int = 0          # prompt tokens found in the prefix cache when it first started
    keys: list[bytes] = field(default_factory=list)    # the prefix-cache keys of its first full blocks
    registered: int = 0             # its first blocks offered to the prefix cache (BlockPool.cache) since it started
    finish_reason: str | None = None
    preemptions: int = 0
    started: float | None = None    # time.monotonic() when it first left the waiting queue (queue time)
    constraint: object | None = None    # structured output's matcher (tilekit.engine.grammar.Constraint), if any

    def __post_init__(self):
        self.tokens = list(self.prompt) + list(self.tokens)

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def remaining(self) -> int:
        """Tokens to compute before the next pick."""
        return len(self.tokens) - self.computed

    @property
    def decoding(self) -> bool:
        return self.status == RUNNING and self.remaining == 1 and len(self.tokens) > len(self.prompt)


@dataclass(frozen=True)
class Chunk:
    """`n` of a request's tokens from position `start` computed this step; `final` when its last one is the
    request's newest token (a pick follows), decided when the step is planned."""

    request: Request
    start: int
    n: int
    final: bool

    @classmethod
    def of(cls, request: Request, n: int) -> "Chunk":
        """The request's next n uncomputed tokens."""
        return cls(request, request.computed, n, request.computed + n == len(request.tokens))


@dataclass
class Step:
    """One step: the decoding requests (one token each, in slot order) and the prefill chunks after them; the
    requests preempted to make room."""

    decodes: list[Request]
    chunks: list[Chunk]
    preempted: list[Request]

    @property
    def tokens(self) -> int:
        return len(self.decodes) + sum(c.n for c in self.chunks)

    @property
    def picks(self) -> list[Request]:
        """The requests whose next token this step picks: the decoding ones, then the finished prefills'."""
        return self.decodes + [c.request for c in self.chunks if c.final]


class Scheduler:
    """The waiting queue, the running requests, and each step's plan over a BlockPool (see the module doc).
    `max_running` caps the running requests (the executor's slots), `token_budget` a step's tokens, `max_len` a
    request's positions (prompt + max_new_tokens), `chunk` a prefill chunk (0: the budget's rest)."""

    def __init__(self, pool: BlockPool, *, max_running: int, token_budget: int, max_len: int, chunk: int = 0):
        for name, value in (("max_running", max_running), ("token_budget", token_budget), ("max_len", max_len)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if token_budget < max_running:
            raise ValueError(f"token_budget ({token_budget}) must be at least max_running ({max_running}): every "
                             "running request decodes one token a step")
        self.pool, self.block = pool, pool.block
        self.max_running, self.token_budget, self.max_len, self.chunk = max_running, token_budget, max_len, chunk
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        """Queue a request (checked: it fits a sequence's positions and, alone, the pool)."""
        need = len(request.prompt) + request.max_new_tokens
        if not request.prompt:
            raise ValueError("a request needs a prompt of at least one token")
        if need > self.max_len:
            raise ValueError(f"prompt length {len(request.prompt)} + max_new_tokens {request.max_new_tokens} exceeds "
                             f"the engine's {self.max_len} positions")
        if -(-need // self.block) > self.pool.num_blocks - 1:
            raise ValueError(f"a request of {need} positions needs more blocks than the KV cache has "
                             f"({self.pool.num_blocks - 1} of {self.block})")
        request.status = WAITING
        self.waiting.append(request)

    @property
    def unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> Step:
        """The next step's plan; the blocks its tokens write into are taken now."""
        preempted, decodes, chunks = [], [], []
        for request in list(self.running):
            if request.status != RUNNING or not request.decoding:
                continue
            while not self._room(request, 1):
                victim = self._preempt(exclude=request)
                if victim is None:
                    break
                preempted.append(victim)
            if request.status == RUNNING and self._room(request, 1):
                decodes.append(request)
        decodes = [r for r in decodes if r.status == RUNNING]      # a later one's preemption may take an earlier
        budget = self.token_budget - len(decodes)
        for request in list(self.running):
            if request.status == RUNNING and not request.decoding and budget > 0:
                n = self._chunk(request, budget)
                while not n:            # no block for its next chunk: later requests make room (the earlier
                    victim = self._preempt(exclude=request, later_only=True)      # ones have planned work)
                    if victim is None:
                        break
                    preempted.append(victim)
                    n = self._chunk(request, budget)
                if n:
                    chunks.append(Chunk.of(request, n))
                    budget -= n
        decodes = [r for r in decodes if r.status == RUNNING]
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            request = self.waiting[0]
            if any(request is p for p in preempted) or not self._start(request):   # preempted now: next step
                break
            self.waiting.popleft()
            self.running.append(request)
            n = self._chunk(request, budget)
            if not n:
                break
            chunks.append(Chunk.of(request, n))
            budget -= n
        return Step(decodes, chunks, preempted)

    def _chunk(self, request: Request, budget: int) -> int:
        """Tokens of a prefilling request this step: its rest, the budget's rest or a chunk, whichever is least,
        with blocks taken for them (fewer where the pool runs short; 0 when none is free)."""
        n = min(request.remaining, budget, self.chunk or budget)
        while n and not self._room(request, n):
            n = min(n - 1, (len(request.blocks) * self.block - request.computed) or n - 1)
        return n

    def _room(self, request: Request, n: int) -> bool:
        """Whether request's next n positions have blocks, taking the missing ones if the pool has them."""
        need = -(-(request.computed + n) // self.block) - len(request.blocks)
        if need <= 0:
            return True
        taken = self.pool.allocate(need)
        if taken is None:
            return False
        request.blocks += taken
        return True

    def _start(self, request: Request) -> bool:
        """A waiting request's start: its cached prefix found (never the whole prompt: its last token is computed
        for the first pick) and the blocks of its first position after it."""
        request.keys = block_hashes(request.tokens[:len(request.tokens) - 1], self.block)
        found = self.pool.lookup(request.keys)
        request.blocks, request.computed, request.registered = found, len(found) * self.block, 0
        if not self._room(request, 1):
            self.pool.release(request.blocks)
            request.blocks, request.computed = [], 0
            return False
        request.status = RUNNING
        if request.started is None:            # its first start: the prefix cache's hits are counted
            request.started = time.monotonic()
            request.cached_tokens = min(request.computed, len(request.prompt))
            self.pool.record_start(len(request.prompt), request.cached_tokens)
        return True

    def _preempt(self, exclude: Request, later_only: bool = False) -> Request | None:
        """The most recently admitted running request other than `exclude` (later_only: admitted after it), stopped:
        its blocks released, back at the front of the waiting queue, to recompute what it had."""
        first = self.running.index(exclude) + 1 if later_only else 0
        for victim in reversed(self.running[first:]):
            if victim is not exclude and victim.status == RUNNING:
                self.running.remove(victim)
                self.pool.release(victim.blocks)
                victim.blocks, victim.computed, victim.status, victim.registered = [], 0, WAITING, 0
                victim.preemptions += 1
                self.waiting.appendleft(victim)
                return victim
        return None

    def advance(self, step: Step, picked: dict[str, int]) -> None:
        """After the step ran: the chunks' tokens are computed (their full blocks cached), and each picked request
        takes its new token; a request that ended while the step ran is left as it ended."""
        for request, n in [(r, 1) for r in step.decodes] + [(c.request, c.n) for c in step.chunks]:
            if request.status == RUNNING:
                request.computed += n
                self._cache_full_blocks(request)
        for request in step.picks:
            if request.status == RUNNING and request.id in picked:
                request.tokens.append(int(picked[request.id]))

    def _cache_full_blocks(self, request: Request) -> None:
        """The request's blocks newly filled this step enter the prefix cache (keys hashed once, chained; each block
        offered once, not every block every step: at 40 full blocks a request that cost ~20 us a step)."""
        full = request.computed // self.block
        known = len(request.keys)
        if full > known:
            parent = request.keys[-1] if known else b""
            request.keys += block_hashes(request.tokens[known * self.block:full * self.block], self.block, parent)
        first = request.registered
        for b, key in zip(request.blocks[first:full], request.keys[first:full]):
            self.pool.cache(b, key)
        request.registered = max(first, full)

    def finish(self, request: Request, reason: str | None) -> None:
        """A request is done (stopped, or aborted): its blocks go back (cached ones stay findable). One finished before
        its reason was known (None: the engine ends it before its text is decoded) takes the reason given next."""
        if request.status == FINISHED:
            if request.finish_reason is None:
                request.finish_reason = reason
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.pool.release(request.blocks)
        request.blocks, request.status, request.finish_reason = [], FINISHED, reason
