"""Requests arriving while an engine runs: what the engine tests drive LLMEngine with."""


def run_ragged(engine, prompts, lengths, every: int, **options) -> list:
    """Add request i (prompts[i], lengths[i] new tokens, `options`) at step every * i, stepping the engine until all
    have finished; returns the Requests in order."""
    reqs = []
    for step in range(10_000):
        if step % every == 0 and len(reqs) < len(prompts):
            i = len(reqs)
            reqs.append(engine.add_request(prompts[i], lengths[i], **options))
        engine.step()
        if len(reqs) == len(prompts) and not engine.has_unfinished:
            return reqs
    raise AssertionError("the engine did not finish")
