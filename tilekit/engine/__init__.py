"""Everything that runs a model rather than defines it (tilekit.models holds the weights and the math):

    runner.py       what every runner offers: generation defaults, argument resolution, text in and out, chat
    static.py       StaticRunner: forward() and static-batch generate() of a GPU model
    steps.py        the passes of a static batch and their device buffers (prefill, chunked prefill, decode step)
    graphs.py       CUDA graph capture and replay: a static batch's Generation, forward()'s PrefillGraph
    kv_cache.py     the static batch's KV caches (per-head keys and values, DeepSeek-V2's latents)
    picker.py       what the GPU next-token pick of a batch is built for
    sampling.py     sampling parameters, generation settings, the float64 reference of the pick
    stops.py        stop rules
    text.py         tokenizers, incremental detokenization, chat templates
    recompute.py    RecomputeRunner: generate() of the NumPy reference models, by recomputation
    workload.py     the kernel problems a model runs (what `tilekit tune --model` tunes)
    lifecycle.py    what runners captured, released before interpreter shutdown
  continuous batching:
    llm.py          LLMEngine (requests in, tokens and text out as each is made) and AsyncEngine (for a server)
    scheduler.py    each step's plan: decodes first, chunked prefill, FCFS admission, preemption by recompute
    blocks.py       the paged KV cache's block pool and prefix cache
    paged.py        PagedExecutor: a step's one forward over the paged KV cache on the GPU, CUDA graphs
    paged_cache.py  the paged caches' pools and attention calls (per-head keys and values, DeepSeek-V2's latents)

A model's generate(), forward(), generate_text() and chat() are thin calls into the runner made here for it
(tilekit.models.running): importing this package registers the factory; it imports nothing heavy itself.
"""

from tilekit.models import running


def make_runner(model):
    """The runner of `model`: RecomputeRunner for a NumPy reference model, StaticRunner for a GPU model."""
    from tilekit.models.reference import ReferenceLM
    if isinstance(model, ReferenceLM):
        from tilekit.engine.recompute import RecomputeRunner
        return RecomputeRunner(model)
    from tilekit.engine.static import StaticRunner
    return StaticRunner(model)


running.register_runner(make_runner)
