"""Chunked prefill (engine.steps.prefill_pieces): a prompt longer than the model's prefill_chunk prefills in chunks whose
queries attend over the cached keys and values of the earlier ones. On the CPU (NumPy standing in for CuPy and for
each kernel): the cache and the decode logits after a chunked prefill equal those after a whole one, for a ragged
batch; the pieces, the recorded workload and the refusals."""

from pathlib import Path

import numpy as np
import pytest

from tests._numpy_cupy import numpy_cupy, step_code_on_numpy  # noqa: F401  (numpy_cupy: a fixture)
from tests.models.llama import numpy_kernels
from tests.models.steps import decode_logits
from tilekit.kernels.checks import rel_err
from tilekit.engine import kv_cache
from tilekit.models import DeepseekV2, DeepseekV2Config, Llama, base
from tilekit.models.llama import model as model_module
from tilekit.models.llama.config import PRESETS
from tilekit.engine.kv_cache import new_cache
from tilekit.engine.picker import GREEDY
from tilekit.engine.steps import capacity_for, DecodeState, prefill_pieces, PromptBuffers
from tilekit.models.base import Arrays

DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.fixture
def cpu(numpy_cupy, monkeypatch):
    step_code_on_numpy(numpy_cupy, monkeypatch, (model_module, numpy_kernels, numpy_kernels.MODEL_KERNELS),
                       (base, numpy_kernels, numpy_kernels.BASE_KERNELS), (kv_cache, numpy_kernels, numpy_kernels.CACHE_KERNELS))


def chunked_decode_logits(model, prompts: np.ndarray, lengths: np.ndarray, follow: np.ndarray):
    """decode_logits with the prompts (B, T; row b's first lengths[b] tokens are its prompt) prefilled in the pieces
    prefill_pieces gives, through DecodeState.prefill (no next-token pick: the decode steps are teacher-forced)."""
    import cupy
    B, T = prompts.shape
    state = DecodeState(model, B, capacity_for(model, T, follow.shape[1] + 1)[0], Arrays(), GREEDY)
    pieces = prefill_pieces(model, T, int(lengths.min()) - 1, state.cache)
    for start, n in pieces:
        buf = PromptBuffers(model, B, n, Arrays())
        buf.ids[...] = cupy.asarray(np.ascontiguousarray(prompts[:, start:start + n]).reshape(-1).astype(np.int32))
        state.prefill(buf, start, final=False)
    acts = model.activations(B, 1, Arrays())
    positions = lengths.astype(np.int32).copy()
    out = []
    for step in range(follow.shape[1]):
        x = model.hidden(acts, follow[:, step].astype(np.int32), positions, model.decode_attend(state.cache, positions))
        model.final_norm(x, acts.h)
        out.append(np.asarray(model.lm_head(acts.h), np.float64))
        positions += 1
    return np.stack(out, 1), state.cache, pieces


def test_a_chunked_prefill_gives_the_whole_prefills_cache_and_logits(cpu):
    model = Llama.from_pretrained(DATA / "tiny-llama", dtype="float32")
    rng = np.random.default_rng(0)
    lengths = np.array([300, 229])                       # ragged: the shorter row's newest token in block 3
    prompts = rng.integers(0, model.config.vocab_size, (2, 320))
    for b, n in enumerate(lengths):
        prompts[b, n:] = 0                               # padding, as generate() pads
    follow = rng.integers(0, model.config.vocab_size, (2, 3))
    model.prefill_chunk = 64
    chunked, cache, pieces = chunked_decode_logits(model, prompts, lengths, follow)
    assert pieces == [(0, 64), (64, 64), (128, 64), (192, 128)]     # chunks up to the block of 228, then the rest
    model.prefill_chunk = 0
    whole, whole_cache, one = chunked_decode_logits(model, prompts, lengths, follow)
    assert one == [(0, 320)]
    for b, n in enumerate(lengths):
        assert rel_err(cache.k[:, b, :, :n], whole_cache.k[:, b, :, :n]) < 1e-6
        assert rel_err(cache.v[:, b, :, :n], whole_cache.v[:, b, :, :n]) < 1e-6
    assert rel_err(chunked, whole) < 1e-6
    # and what the unchunked prefill helper of the other tests computes (whole prompts, row 0's length)
    reference, _ = decode_logits(model, prompts[:1, :300], follow[:1])
    assert rel_err(chunked[:1], reference) < 1e-6


def test_pieces():
    model = Llama(PRESETS["llama-3.2-1b"], meta=True)
    cache = new_cache(model, 1, 32768, Arrays(meta=True))
    assert model.prefill_chunk == 8192
    assert prefill_pieces(model, 8192, 8191, cache) == [(0, 8192)]             # no longer than a chunk: whole
    assert prefill_pieces(model, 20032, 20000, cache) == [(0, 8192), (8192, 8192), (16384, 3584), (19968, 64)]
    assert prefill_pieces(model, 16384, 16383, cache) == [(0, 8192), (8192, 8128), (16320, 64)]
    # a ragged batch: chunks up to the shortest prompt's newest token, then every row's rest in one pass
    assert prefill_pieces(model, 20032, 9000, cache) == [(0, 8192), (8192, 768), (8960, 11072)]
    assert prefill_pieces(model, 20032, 40, cache) == [(0, 20032)]             # nothing before the first block
    fp8 = new_cache(model, 1, 32768, Arrays(meta=True), "fp8")                   # earlier chunks' keys are FP8 codes
    assert prefill_pieces(model, 20032, 20000, fp8) == [(0, 20032)]
    latent = DeepseekV2(DeepseekV2Config.preset("deepseek-v2-lite"), meta=True)
    assert latent.prefill_chunk == 0
    assert prefill_pieces(latent, 20032, 20000, new_cache(latent, 1, 20096, Arrays(meta=True))) == [(0, 20032)]
    for bad in (100, -64, 64.0, True, "8192"):
        model.prefill_chunk = bad
        with pytest.raises(ValueError, match=f"prefill_chunk must be 0 .off. or a positive multiple of 64, got "):
            prefill_pieces(model, 20032, 20000, cache)


def test_the_workload_of_a_long_prompt_is_its_chunks():
    """`tilekit tune --seq-lens 20000` tunes what generate() runs: attention over each chunk's queries and the
    cached positions before them, the projections at a chunk's rows."""
    model = Llama(PRESETS["llama-3.2-1b"].replace(n_layer=1), meta=True)
    calls = model.kernel_problems(1, 20000, 4)
    attention = sorted({(p["Tq"], p["Tk"]) for op, p in calls if op.name == "attention"})
    assert attention == [(64, 20032), (3584, 19968), (8192, 8192), (8192, 16384)]
    rows = {p["M"] for op, p in calls if op.name == "linear"}
    assert max(rows) == 8192 and 20032 not in rows
