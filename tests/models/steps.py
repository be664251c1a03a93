"""A model's generate() steps without graphs, teacher-forced, for tests on the GPU and (NumPy standing in for CuPy)
on the CPU."""

import numpy as np

from tilekit.engine.kv_cache import new_cache
from tilekit.engine.steps import PromptBuffers, capacity_for
from tilekit.models.base import Arrays


def decode_logits(model, prompts: np.ndarray, follow: np.ndarray, kv_cache_dtype: str = "auto") -> tuple:
    """generate()'s steps without graphs, teacher-forced: the prompts (B, T) prefilled into a cache of
    kv_cache_dtype, then each column of follow (B, steps) decoded; the float64 logits (B, steps, vocab) of the
    decode steps and the cache (CuPy arrays, or NumPy under the numpy_cupy fixture)."""
    import cupy
    B, T = prompts.shape
    arrays = Arrays()
    cache = new_cache(model, B, capacity_for(model, T, follow.shape[1] + 1)[0], arrays, kv_cache_dtype)
    buf = PromptBuffers(model, B, T, arrays)
    buf.ids[...] = cupy.asarray(prompts.reshape(-1).astype(np.int32))
    model.hidden(buf.acts, buf.ids, buf.positions, model.prefill_attend(cache, buf.zeros))
    acts = model.activations(B, 1, arrays)
    positions = cupy.asarray(np.full(B, T, np.int32))
    out = []
    for step in range(follow.shape[1]):
        x = model.hidden(acts, cupy.asarray(follow[:, step].astype(np.int32)), positions,
                         model.decode_attend(cache, positions))
        model.final_norm(x, acts.h)
        out.append(cupy.asnumpy(model.lm_head(acts.h)).astype(np.float64))
        positions += 1
    return np.stack(out, 1), cache


def check_past_the_window(model, reference, prompt_len: int, window: int, tol: float, steps: int = 4,
                          rng=None) -> None:
    """A random prompt of prompt_len tokens and `steps` decode steps after it: the prefill logits past the
    position window and the decode logits against the float64 reference model's forward of the whole."""
    import cupy

    from tilekit.kernels.checks import rel_err
    rng = rng or np.random.default_rng(1)
    vocab = model.config.vocab_size
    prompt, follow = rng.integers(0, vocab, (1, prompt_len)), rng.integers(0, vocab, (1, steps))
    expected = reference.forward(np.concatenate([prompt, follow], 1))
    prefill = cupy.asnumpy(model(prompt)).astype(np.float64)
    assert rel_err(prefill[:, window:], expected[:, window:prompt_len]) <= tol
    decoded, _ = decode_logits(model, prompt, follow)
    assert rel_err(decoded, expected[:, prompt_len:]) <= tol
