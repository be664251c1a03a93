"""engine.scheduler on the CPU: a fake model whose next token is a function of the whole sequence, so that any
mistake in what is computed (a lost token, a wrong prefix, a preempted request resumed wrong) changes the output."""

import random

import pytest

from tilekit.engine.blocks import BlockPool
from tilekit.engine.scheduler import FINISHED, RUNNING, WAITING, Request, Scheduler


def next_of(seq) -> int:
    return (sum((i + 1) * t for i, t in enumerate(seq)) * 7 + len(seq)) % 101


def alone(prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_of(seq))
    return seq[len(prompt):]


def run(scheduler: Scheduler, requests, arrivals=None, check=None):
    """Step until every request has its max_new_tokens; arrivals: step -> requests added then. Checks that each
    step computes exactly the tokens it plans (in order, none twice) within its budget."""
    arrivals = arrivals or {0: requests}
    steps = 0
    while steps == 0 or scheduler.unfinished or any(s > steps for s in arrivals):
        for r in arrivals.get(steps, []):
            scheduler.add(r)
        step = scheduler.schedule()
        assert step.tokens <= scheduler.token_budget
        assert len(scheduler.running) <= scheduler.max_running
        for r in step.decodes:
            assert r.computed == len(r.tokens) - 1
        for r in step.decodes + [c.request for c in step.chunks]:
            assert r.status == RUNNING and r not in step.preempted
        for c in step.chunks:
            assert c.start == c.request.computed and c.n > 0
            assert len(c.request.blocks) * scheduler.block >= c.start + c.n
        if check:
            check(step)
        picked = {r.id: next_of(r.tokens) for r in step.picks}
        scheduler.advance(step, picked)
        for r in step.picks:
            if len(r.output) >= r.max_new_tokens:
                scheduler.finish(r, "length")
        steps += 1
        assert steps < 10_000
    return steps


def prompts(n, seed=0, low=1, high=40):
    rng = random.Random(seed)
    return [[rng.randrange(100) for _ in range(rng.randint(low, high))] for _ in range(n)]


@pytest.mark.parametrize("blocks", [200, 24])
def test_every_output_equals_the_request_run_alone(blocks):
    pool = BlockPool(blocks, 4)
    sched = Scheduler(pool, max_running=6, token_budget=16, max_len=80, chunk=8)
    reqs = [Request(p, n) for p, n in zip(prompts(20), [5, 12, 1, 30] * 5)]
    arrivals = {3 * i: [r] for i, r in enumerate(reqs)}
    run(sched, reqs, arrivals)
    for r in reqs:
        assert r.status == FINISHED and r.output == alone(r.prompt, r.max_new_tokens), r.id
    assert pool.used == 0 and sum(pool.refs) == 0
    if blocks == 24:
        assert sum(r.preemptions for r in reqs) > 0       # the small pool did preempt


def test_decodes_come_first_then_chunks_within_the_budget():
    pool = BlockPool(100, 4)
    sched = Scheduler(pool, max_running=4, token_budget=10, max_len=64)
    short, long_ = Request([1, 2], 20), Request(list(range(30)), 3)
    seen = []

    def check(step):
        seen.append((len(step.decodes), [c.n for c in step.chunks]))
    run(sched, [short], {0: [short], 2: [long_]}, check)
    assert seen[0] == (0, [2]) and seen[1] == (1, [])
    assert seen[2] == (1, [9]) and seen[3] == (1, [9])       # the long prompt in chunks of the budget's rest
    assert short.output == alone(short.prompt, 20) and long_.output == alone(long_.prompt, 3)


def test_first_come_first_served_and_the_running_cap():
    pool = BlockPool(100, 4)
    sched = Scheduler(pool, max_running=2, token_budget=64, max_len=64)
    reqs = [Request([i + 1] * 3, 4) for i in range(5)]
    order = []

    def check(step):
        for c in step.chunks:
            if c.start == 0 and c.request.id not in order:
                order.append(c.request.id)
    run(sched, reqs, check=check)
    assert order == [r.id for r in reqs]


def test_a_preempted_request_goes_back_to_the_front_and_recomputes():
    pool = BlockPool(5, 4)                      # 4 usable blocks: 16 positions
    sched = Scheduler(pool, max_running=2, token_budget=32, max_len=16)
    a, b = Request([1] * 6, 8), Request([2] * 6, 8)   # 14 positions each: both cannot finish together
    run(sched, [a, b])
    assert b.preemptions >= 1 and a.preemptions == 0
    assert a.output == alone(a.prompt, 8) and b.output == alone(b.prompt, 8)


def test_a_shared_prefix_is_found_and_only_the_rest_computed():
    pool = BlockPool(64, 4)
    sched = Scheduler(pool, max_running=4, token_budget=64, max_len=64)
    system = list(range(20, 32))                # three full blocks
    first = Request(system + [1, 2], 4)
    run(sched, [first])
    second = Request(system + [3], 4)
    computed = []
    run(sched, [second], check=lambda step: computed.extend(c.n for c in step.chunks))
    assert second.cached_tokens == 12 and computed[0] == 1
    assert second.output == alone(second.prompt, 4)
    assert pool.hit_rate == pytest.approx(12 / (14 + 13))
    again = Request(system, 2)                  # the whole prompt cached: its last token is still computed
    run(sched, [again])
    assert again.cached_tokens == 8 and again.output == alone(system, 2)


def test_finish_and_abort_return_blocks_at_any_time():
    pool = BlockPool(20, 4)
    sched = Scheduler(pool, max_running=4, token_budget=8, max_len=64)
    waiting, running = Request([5] * 30, 4), Request([6] * 3, 4)
    sched.add(running)
    sched.advance(sched.schedule(), {running.id: 1})
    sched.add(waiting)
    sched.schedule()
    assert running.status == RUNNING and waiting.status == RUNNING and pool.used > 0
    sched.finish(waiting, "abort")
    sched.finish(running, "abort")
    sched.finish(running, "abort")              # twice is harmless
    assert pool.used == 0 and sched.unfinished == 0 and waiting.finish_reason == "abort"
    queued = Request([7], 2)
    sched.add(queued)
    assert queued.status == WAITING
    sched.finish(queued, "abort")
    assert sched.unfinished == 0


def test_requests_that_cannot_fit_are_refused_when_added():
    sched = Scheduler(BlockPool(3, 4), max_running=2, token_budget=8, max_len=12)
    with pytest.raises(ValueError, match="exceeds the engine's 12 positions"):
        sched.add(Request([1] * 10, 3))
    with pytest.raises(ValueError, match="more blocks than the KV cache has"):
        sched.add(Request([1] * 9, 3))
    with pytest.raises(ValueError, match="prompt"):
        sched.add(Request([], 3))
    with pytest.raises(ValueError, match="token_budget"):
        Scheduler(BlockPool(3, 4), max_running=8, token_budget=4, max_len=12)


def test_a_preempted_request_resuming_is_no_prefix_hit():
    pool = BlockPool(5, 4)
    sched = Scheduler(pool, max_running=2, token_budget=32, max_len=16)
    a, b = Request([1] * 6, 8), Request([2] * 6, 8)
    run(sched, [a, b])
    assert b.preemptions >= 1
    assert pool.queried_tokens == 12 and pool.hit_tokens == 0 and b.cached_tokens == 0


def test_a_request_waiting_for_blocks_is_counted_once():
    pool = BlockPool(4, 4)
    sched = Scheduler(pool, max_running=2, token_budget=4, max_len=12)
    a, b = Request([1] * 8, 4), Request([2] * 3, 2)
    run(sched, [a, b])
    assert pool.queried_tokens == 11


def test_prefilling_requests_that_fill_the_pool_do_not_deadlock():
    """Every running request prefilling in chunks and no block free: the later ones are preempted for the first."""
    pool = BlockPool(7, 4)                      # 6 usable blocks: 24 positions
    sched = Scheduler(pool, max_running=3, token_budget=6, max_len=24, chunk=4)
    reqs = [Request([i + 1] * 18, 2) for i in range(3)]      # 20 positions each: one fits at a time
    steps = run(sched, reqs)
    assert steps < 200
    for r in reqs:
        assert r.output == alone(r.prompt, 2)
    assert sum(r.preemptions for r in reqs) > 0 and pool.used == 0


def test_each_full_block_is_offered_to_the_prefix_cache_once_and_again_after_preemption():
    """A block enters the prefix cache once it is full, and is not offered again each later step (that cost grew with
    a sequence's length); a preempted request's recomputed blocks are offered anew, so its prefix is found after."""
    pool = BlockPool(5, 4)
    offered = []
    cache = pool.cache
    pool.cache = lambda b, key: (offered.append((b, key)), cache(b, key))[1]
    sched = Scheduler(pool, max_running=2, token_budget=32, max_len=16)
    a, b = Request([1] * 6, 8), Request([2] * 6, 8)      # b is preempted and recomputed (as in the test above)
    run(sched, [a, b])
    assert b.preemptions >= 1
    offers = {r.id: [key for _, key in offered if key in r.keys] for r in (a, b)}
    assert len(offers[a.id]) == len(set(offers[a.id])) == 3        # 13 positions computed: 3 full blocks, once each
    assert len(set(offers[b.id])) == 3 and 3 < len(offers[b.id]) <= 6       # and again after its preemption
    again = Request([2] * 6 + alone([2] * 6, 8)[:3], 1)
    run(sched, [again])
    assert again.cached_tokens == 8
