"""engine.llm on the CPU: continuous batching of the NumPy reference GPT-2 (RecomputeExecutor) against the same
requests run alone through generate(): ragged arrivals, preemption and prefix hits, stop rules, streaming, abort,
the async API."""

import asyncio
import time
import os

import numpy as np
import pytest

from tests.engine.arrivals import run_ragged
from tilekit.engine.llm import AsyncEngine, LLMEngine
from tilekit.models.gpt2.reference import ReferenceGPT

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "tiny-gpt2")


@pytest.fixture(scope="module")
def model():
    return ReferenceGPT.from_pretrained(DATA)


def prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, 1000, int(rng.integers(1, 20)))] for _ in range(n)]


def alone(model, prompt, n, **options):
    return [int(t) for t in model.generate([prompt], n, **options)[0][len(prompt):]]


@pytest.mark.parametrize("num_blocks", [64, 9])
def test_greedy_outputs_equal_each_request_run_alone(model, num_blocks):
    engine = LLMEngine(model, max_running=4, token_budget=8, block=4, num_blocks=num_blocks)
    ps = prompts(7) + [[5, 6, 7, 8, 9, 10, 11, 12, 1]] * 2          # the last two share two full blocks
    lengths = [3, 11, 6, 1, 9, 4, 8, 5, 5]
    reqs = run_ragged(engine, ps, lengths, 2, temperature=0, ignore_eos=True)     # one arrival every other step
    for r, p, n in zip(reqs, ps, lengths):
        assert r.output == alone(model, p, n, temperature=0, eos_token_id=[]), r.id
    stats = engine.stats()
    assert stats["blocks_used"] == 0 and stats["finished"] == len(ps)
    if num_blocks == 9:
        assert stats["preemptions"] > 0
    else:
        assert reqs[-1].cached_tokens == 8


def test_sampled_tokens_do_not_depend_on_the_batch(model):
    one = LLMEngine(model, max_running=1, token_budget=8, block=4)
    many = LLMEngine(model, max_running=4, token_budget=8, block=4)
    ps = prompts(4, seed=1)
    opts = dict(temperature=0.9, top_k=40, top_p=0.9, seed=7, ignore_eos=True)
    alone_ = [one.generate([p], 8, **opts)[0]["token_ids"] for p in ps]
    together = [o["token_ids"] for o in many.generate(ps, 8, **opts)]
    assert alone_ == together
    other_seed = many.generate(ps, 8, **dict(opts, seed=8))
    assert [o["token_ids"] for o in other_seed] != together


def test_streamed_text_and_stop_rules(model):
    engine = LLMEngine(model, max_running=2, token_budget=16, block=4)
    prompt = prompts(1, seed=2)[0]
    full = engine.generate([prompt], 12, temperature=0, ignore_eos=True)[0]
    assert full["finish_reason"] == "length" and len(full["token_ids"]) == 12
    words = full["text"]
    stop = words[len(words) // 2:len(words) // 2 + 2]
    stopped = engine.generate([prompt], 12, temperature=0, ignore_eos=True, stop_strings=[stop])[0]
    assert stopped["finish_reason"] == "stop"
    assert stopped["text"] == words[:words.index(stop)]               # the stop string and what follows cut
    eos = full["token_ids"][3]
    by_id = engine.generate([prompt], 12, temperature=0, stop_token_ids=[eos])[0]
    first = full["token_ids"].index(eos)
    assert by_id["finish_reason"] == "stop" and by_id["token_ids"] == full["token_ids"][:first + 1]
    late = engine.generate([prompt], 12, temperature=0, stop_token_ids=[eos], min_new_tokens=6)[0]
    assert eos not in late["token_ids"][:6]


def test_deltas_add_up_to_the_text_and_abort_returns_blocks(model):
    engine = LLMEngine(model, max_running=2, token_budget=16, block=4)
    a = engine.add_request(prompts(1, seed=3)[0], 10, temperature=0, ignore_eos=True)
    b = engine.add_request(prompts(1, seed=4)[0], 30, temperature=0, ignore_eos=True)
    text = {a.id: "", b.id: ""}
    done = None
    for _ in range(40):
        for out in engine.step():
            text[out.request_id] += out.text
            if out.finished:
                done = out
        if done:
            break
    with pytest.raises(RuntimeError, match="still running"):
        engine.generate([a.prompt], 10)
    again = LLMEngine(model, max_running=2, token_budget=16, block=4)
    assert done.request_id == a.id
    assert text[a.id] == again.generate([a.prompt], 10, temperature=0, ignore_eos=True)[0]["text"]
    assert engine.pool.used > 0
    assert engine.abort(b.id) and not engine.abort(b.id)
    assert engine.pool.used == 0 and not engine.has_unfinished and b.finish_reason == "abort"


def test_bad_requests_are_refused_naming_the_argument(model):
    engine = LLMEngine(model, max_running=2, token_budget=8, block=4)
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request([], 4)
    with pytest.raises(ValueError, match=r"\[0, 1031\)|prompt"):
        engine.add_request([10 ** 6], 4)
    with pytest.raises(ValueError, match="positions"):
        engine.add_request([1] * 60, 10)
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request([1], 4, temperature=-1)
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.add_request([1], 4, stop_token_ids=[10 ** 6])
    with pytest.raises(ValueError, match="max_len"):
        LLMEngine(model, max_len=10 ** 6)
    assert not engine.has_unfinished


def test_the_async_engine_streams_and_aborts_a_consumer_that_leaves(model):
    engine = AsyncEngine(LLMEngine(model, max_running=4, token_budget=16, block=4))

    async def main():
        request, outputs = await engine.submit([1, 2, 3], 6, temperature=0, ignore_eos=True)
        got = [o async for o in outputs]
        assert [t for o in got for t in o.token_ids] == alone(model, [1, 2, 3], 6, temperature=0, eos_token_id=[])
        assert got[-1].finished and got[-1].finish_reason == "length"
        request, outputs = await engine.submit([4, 5], 40, temperature=0, ignore_eos=True)
        async for _ in outputs:
            break                                  # the client went away
        await outputs.aclose()
        for _ in range(200):
            if not engine.engine.has_unfinished:
                break
            await asyncio.sleep(0.01)
        assert request.finish_reason == "abort" and engine.engine.pool.used == 0
        with pytest.raises(ValueError, match="prompt"):
            await engine.submit([], 4)
    try:
        asyncio.run(main())
    finally:
        engine.shutdown(timeout=5)
    assert not engine.thread.is_alive()


def test_shutdown_lets_running_requests_finish(model):
    engine = AsyncEngine(LLMEngine(model, max_running=2, token_budget=8, block=4))
    got = []

    async def main():
        request, outputs = await engine.submit([1, 2, 3], 30, temperature=0, ignore_eos=True)
        consumer = asyncio.ensure_future(_collect(outputs, got))
        await asyncio.sleep(0.01)
        await asyncio.to_thread(engine.shutdown, None)
        await consumer
        return request
    request = asyncio.run(main())
    assert sum(len(o.token_ids) for o in got) == 30 and got[-1].completion_tokens == 30
    assert got[-1].finish_reason == "length" and request.finish_reason == "length"
    assert [t for o in got for t in o.token_ids] == request.output


def test_a_consumer_behind_the_engine_gets_what_it_missed_as_one_output(model):
    engine = AsyncEngine(LLMEngine(model, max_running=2, token_budget=8, block=4))
    alone = LLMEngine(model, max_running=2, token_budget=8, block=4).generate([[1, 2, 3]], 12, temperature=0,
                                                                             ignore_eos=True)[0]

    async def main():
        _, outputs = await engine.submit([1, 2, 3], 12, temperature=0, ignore_eos=True)
        await asyncio.to_thread(time.sleep, 0.5)        # the engine runs all 12 steps meanwhile
        return [out async for out in outputs]
    got = asyncio.run(main())
    engine.shutdown()
    assert len(got) < 12 and got[-1].finished and got[-1].completion_tokens == 12
    assert [t for o in got for t in o.token_ids] == alone["token_ids"]
    assert "".join(o.text for o in got) == alone["text"]


async def _collect(outputs, into):
    async for out in outputs:
        into.append(out)


def test_a_failed_engine_answers_every_request_and_refuses_new_ones(model):
    llm = LLMEngine(model, max_running=2, token_budget=8, block=4)

    def broken(step, constraints):
        raise RuntimeError("boom")
    llm.executor.launch = broken
    engine = AsyncEngine(llm)

    async def main():
        request, outputs = await engine.submit([1, 2, 3], 5, temperature=0)
        with pytest.raises(RuntimeError, match="boom"):
            async for _ in outputs:
                pass
        with pytest.raises(RuntimeError, match="the engine failed: boom"):
            await asyncio.wait_for(engine.submit([1, 2, 3], 5, temperature=0), 5)
    asyncio.run(main())
    engine.shutdown(timeout=1)


def test_more_eos_ids_than_the_pick_takes_are_refused(model):
    engine = LLMEngine(model, max_running=2, token_budget=8, block=4)
    with pytest.raises(ValueError, match="at most 32 ids"):
        engine.add_request([1], 4, stop_token_ids=list(range(40)))


def test_steps_are_pipelined_and_what_ends_while_a_step_runs_is_dropped(model):
    """step() launches the next step before it decodes the text of the last one: a request a stop string ends was
    launched once more, and that pick is dropped (its tokens end with the one that completed the string, as run
    alone, and no block stays taken); a request aborted while its step runs gets nothing more."""
    engine = LLMEngine(model, max_running=2, token_budget=16, block=4)
    prompt = prompts(1, seed=2)[0]
    full = engine.generate([prompt], 12, temperature=0, ignore_eos=True)[0]
    tokenizer = engine.runner.tokenizer()
    stop = full["text"][len(full["text"]) // 2:len(full["text"]) // 2 + 2]
    ends = next(k for k in range(1, 13) if stop in tokenizer.decode(full["token_ids"][:k]))
    before = engine.counters["generation_tokens"]
    outs = engine.generate([prompt, prompts(1, seed=5)[0]], 12, temperature=0, ignore_eos=True,
                           sampling=[dict(stop_strings=[stop]), {}])
    assert outs[0]["token_ids"] == full["token_ids"][:ends] and outs[0]["finish_reason"] == "stop"
    assert engine.counters["generation_tokens"] - before == ends + 12
    assert engine.pool.used == 0 and not engine.has_unfinished

    a = engine.add_request(prompt, 8, temperature=0, ignore_eos=True)
    assert engine.step() == []                 # launched: its outputs come with the next call
    first = engine.step()
    assert [o.token_ids for o in first] == [full["token_ids"][:1]]
    assert engine.abort(a.id)                  # its second step is running
    assert engine.step() == [] and engine.pool.used == 0 and not engine.has_unfinished
    assert engine.generate([prompt], 3, temperature=0, ignore_eos=True)[0]["token_ids"] == full["token_ids"][:3]
