"""engine.paged's PagedExecutor on the CPU: the GPU executor's own step code (slots, flattened decode + prefill
rows, block tables, write slots, query tiles, the final norm's rows) with NumPy standing in for CuPy and each kernel
(the paged ops from their float64 references, next_token greedy), driven by LLMEngine; every greedy output equals
the float64 reference model's, with ragged arrivals, chunked prefill, preemption and prefix hits."""

import types
from pathlib import Path

import numpy as np
import pytest

from tests._numpy_cupy import numpy_cupy, step_code_on_numpy  # noqa: F401  (numpy_cupy: a fixture)
from tests.engine.arrivals import run_ragged
from tests.models.deepseek_v2 import numpy_kernels as deepseek_kernels
from tests.models.gpt2 import numpy_kernels as gpt2_kernels
from tests.models.llama import numpy_kernels
from tilekit.engine import kv_cache, paged, paged_cache
from tilekit.engine.llm import LLMEngine
from tilekit.kernels.paged_decode_attention import paged_decode_attention_reference
from tilekit.kernels.paged_mla_decode_attention import paged_mla_decode_attention_reference
from tilekit.kernels.paged_prefill_attention import paged_prefill_attention_reference
from tilekit.kernels.paged_write_kv import paged_write_kv_reference
from tilekit.kernels.token_bitmask import token_bitmask_reference
from tilekit.models import GPT, DeepseekV2, Llama, base
from tilekit.models.deepseek_v2 import model as deepseek_module
from tilekit.models.deepseek_v2.reference import ReferenceDeepseekV2
from tilekit.models.gpt2 import model as gpt2_module
from tilekit.models.gpt2.reference import ReferenceGPT
from tilekit.models.llama import model as model_module
from tilekit.models.llama.reference import ReferenceLlama

DATA = Path(__file__).resolve().parents[1] / "data" / "tiny-llama"


class PagedKernels:
    """The kernels engine.paged calls, as NumPy functions writing into the given views."""

    calls = {"decode": 0, "prefill": 0, "mla": 0}

    @staticmethod
    def paged_write_kv(k, v, k_pool, v_pool, slots, k_scale=None, v_scale=None):
        kp, vp = paged_write_kv_reference(k, v, k_pool, v_pool, slots, k_scale=k_scale, v_scale=v_scale)
        k_pool[...], v_pool[...] = kp, vp

    @classmethod
    def paged_decode_attention(cls, q, k_pool, v_pool, table, lengths, *, new_k, new_v, length_offset, out,
                               k_scale=None, v_scale=None):
        cls.calls["decode"] += 1
        o, kp, vp = paged_decode_attention_reference(q, k_pool, v_pool, np.asarray(table), np.asarray(lengths),
                                                     new_k=new_k, new_v=new_v, length_offset=length_offset,
                                                     k_scale=k_scale, v_scale=v_scale)
        k_pool[...], v_pool[...], out[...] = kp, vp, o

    @classmethod
    def paged_prefill_attention(cls, q, k_pool, v_pool, table, tiles, *, out, k_scale=None, v_scale=None):
        cls.calls["prefill"] += 1
        tiles = np.asarray(tiles)
        live = tiles[tiles[:, 2] > 0]
        if not len(live):
            return
        requests = sorted(set(live[:, 0]))
        assert requests == list(range(len(requests)))       # requests stacked in order from row 0
        lengths = [int(live[live[:, 0] == r, 2].sum()) for r in requests]
        starts = [int(live[live[:, 0] == r, 3].min()) for r in requests]
        assert list(live[:, 1]) == sorted(live[:, 1]) and live[0, 1] == 0
        o = paged_prefill_attention_reference(q[:sum(lengths)], k_pool, v_pool, np.asarray(table), lengths, starts,
                                              k_scale=k_scale, v_scale=v_scale)
        out[:sum(lengths)] = o

    @classmethod
    def paged_mla_decode_attention(cls, q, q_pe, c_pool, pe_pool, table, lengths, *, scale, new_c=None, new_pe=None,
                                   length_offset=0, out):
        cls.calls["mla"] += 1
        o, cp, pp = paged_mla_decode_attention_reference(q, q_pe, c_pool, pe_pool, table, lengths, scale=scale,
                                                         new_c=new_c, new_pe=new_pe, length_offset=length_offset)
        c_pool[...], pe_pool[...], out[...] = cp, pp, o

    @staticmethod
    def token_bitmask(logits, mask):
        logits[...] = token_bitmask_reference(logits, mask)

    @staticmethod
    def mask_tokens(logits, flat_index, dtype):
        logits.reshape(-1)[np.asarray(flat_index)] = -np.inf

    @staticmethod
    def next_token(logits, fparams, iparams, eos, tokens, positions, history, finished, *, seen=None,
                   out_counts=None, slots=0, check=False, pad=0):
        x = np.array(logits, np.float64)
        banned = np.asarray(positions) < np.asarray(iparams)[:, 2]
        for e in np.asarray(eos):
            if e >= 0:
                x[banned, e] = -np.inf
        picked = x.argmax(-1).astype(np.int32)
        tokens[...] = picked
        for b, (t, p) in enumerate(zip(picked, np.asarray(positions))):
            history[b, p + 1] = t
            if seen is not None:
                seen[b, t] += 1
                out_counts[b, t] += 1
        positions += 1


class FakeStream:
    ptr = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        pass


def executor_on_numpy(numpy_cupy, monkeypatch, *model_kernels) -> None:
    """The executor's step code and the given models' on the CPU, every kernel a NumPy stand-in."""
    step_code_on_numpy(numpy_cupy, monkeypatch, *model_kernels,
                       (paged_cache, PagedKernels, ("paged_write_kv", "paged_decode_attention",
                                                    "paged_prefill_attention", "paged_mla_decode_attention")),
                       (paged, PagedKernels, ("next_token", "mask_tokens", "token_bitmask")))
    numpy_cupy.lib, numpy_cupy.copyto, numpy_cupy.take = np.lib, np.copyto, np.take
    numpy_cupy.cuda = types.SimpleNamespace(Stream=lambda non_blocking=True: FakeStream())


@pytest.fixture
def cpu(numpy_cupy, monkeypatch):
    executor_on_numpy(numpy_cupy, monkeypatch, (model_module, numpy_kernels, numpy_kernels.MODEL_KERNELS),
                      (base, numpy_kernels, numpy_kernels.BASE_KERNELS),
                      (kv_cache, numpy_kernels, numpy_kernels.CACHE_KERNELS),
                      (gpt2_module, gpt2_kernels, gpt2_kernels.KERNELS))


@pytest.fixture
def cpu_deepseek(numpy_cupy, monkeypatch):
    executor_on_numpy(numpy_cupy, monkeypatch, (deepseek_module, deepseek_kernels, deepseek_kernels.KERNELS),
                      (base, deepseek_kernels, deepseek_kernels.BASE_KERNELS))


@pytest.fixture(scope="module")
def reference():
    return ReferenceLlama.from_pretrained(DATA)


def expected(reference, prompt, n):
    return [int(t) for t in reference.generate([prompt], n, temperature=0, eos_token_id=[])[0][len(prompt):]]


@pytest.mark.parametrize("num_blocks,every", [(40, 3), (5, 1)])
def test_greedy_outputs_equal_the_reference(cpu, reference, num_blocks, every):
    model = Llama.from_pretrained(DATA, dtype="float32")
    engine = LLMEngine(model, max_running=3, token_budget=40, block=16, num_blocks=num_blocks, max_len=64,
                       use_graphs=False)
    rng = np.random.default_rng(0)
    shared = [int(t) for t in rng.integers(0, 256, 33)]                # two full blocks and a bit
    prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in (5, 50, 17, 2)] + [shared + [1], shared + [2]]
    lengths = [6, 4, 9, 12, 5, 7] if every > 1 else [20, 10, 30, 25, 12, 20]
    before = dict(PagedKernels.calls)
    reqs = run_ragged(engine, prompts, lengths, every, temperature=0, ignore_eos=True)
    for r, p, n in zip(reqs, prompts, lengths):
        assert r.output == expected(reference, p, n), r.id
    assert engine.pool.used == 0 and not engine.executor.slot_of
    assert PagedKernels.calls["decode"] > before["decode"] and PagedKernels.calls["prefill"] > before["prefill"]
    if num_blocks == 5:
        assert engine.counters["preemptions"] > 0
    else:
        assert reqs[-1].cached_tokens == 32


def test_gpt2_greedy_outputs_equal_the_reference(cpu):
    """GPT-2's decode passes keep their fixed-point residual stream (passes of <= 16 rows), its prefill passes the
    model's dtype: each in a pass of its own, as generate() computes them."""
    model = GPT.from_pretrained(DATA.parent / "tiny-gpt2", dtype="float32")
    reference = ReferenceGPT.from_pretrained(DATA.parent / "tiny-gpt2")
    engine = LLMEngine(model, max_running=3, token_budget=40, block=16, num_blocks=12, max_len=64, use_graphs=False)
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(0, 1000, n)] for n in (5, 30, 12, 3)]
    lengths = [9, 6, 12, 20]
    reqs = run_ragged(engine, prompts, lengths, 2, temperature=0, ignore_eos=True)
    for r, p, n in zip(reqs, prompts, lengths):
        assert r.output == expected(reference, p, n), r.id
    assert engine.executor.decode_acts[1].fixed and not engine.executor.prefill_acts[64].fixed


def test_min_new_tokens_bans_eos_for_its_request_only(cpu, reference):
    model = Llama.from_pretrained(DATA, dtype="float32")
    engine = LLMEngine(model, max_running=2, token_budget=32, block=16, num_blocks=12, max_len=64, use_graphs=False)
    prompt = [3, 4, 5]
    free = expected(reference, prompt, 6)
    out = engine.generate([prompt, prompt], 6, sampling=[dict(stop_token_ids=[free[1]]),
                                                         dict(stop_token_ids=[free[1]], min_new_tokens=4)],
                          temperature=0, ignore_eos=True)
    assert out[0]["token_ids"] == free[:free.index(free[1]) + 1] and out[0]["finish_reason"] == "stop"
    assert free[1] not in out[1]["token_ids"][:4]


@pytest.mark.parametrize("num_blocks,every", [(40, 3), (6, 1)])
def test_deepseek_greedy_outputs_equal_the_reference(cpu_deepseek, num_blocks, every):
    """DeepSeek-V2's paged latent cache: decode rows and prompt-chunk rows alike in the absorbed form over the blocks
    (a chunk's entries written first), ragged arrivals, chunked prefill, preemption and prefix hits."""
    model = DeepseekV2.from_pretrained(DATA.parent / "tiny-deepseek-v2", dtype="float32")
    reference = ReferenceDeepseekV2.from_pretrained(DATA.parent / "tiny-deepseek-v2")
    engine = LLMEngine(model, max_running=3, token_budget=40, block=16, num_blocks=num_blocks, max_len=80,
                       use_graphs=False)
    rng = np.random.default_rng(7)
    V = model.config.vocab_size
    shared = [int(t) for t in rng.integers(0, V, 33)]
    prompts = [[int(t) for t in rng.integers(0, V, n)] for n in (5, 50, 17)] + [shared + [1], shared + [2]]
    lengths = [6, 4, 9, 5, 7] if every > 1 else [20, 10, 26, 12, 20]
    before = PagedKernels.calls["mla"]
    reqs = run_ragged(engine, prompts, lengths, every, temperature=0, ignore_eos=True)
    for r, p, n in zip(reqs, prompts, lengths):
        assert r.output == expected(reference, p, n), (r.id, r.preemptions, r.cached_tokens)
    assert engine.pool.used == 0 and not engine.executor.slot_of
    assert PagedKernels.calls["mla"] > before
    if num_blocks == 6:
        assert engine.counters["preemptions"] > 0
    else:
        assert reqs[-1].cached_tokens == 32


def test_bad_engine_options_are_refused(cpu):
    model = DeepseekV2.from_pretrained(DATA.parent / "tiny-deepseek-v2", dtype="float32")
    with pytest.raises(ValueError, match="latent cache is kept in the model's dtype"):
        LLMEngine(model, num_blocks=8, use_graphs=False, kv_cache_dtype="fp8")
    llama = Llama.from_pretrained(DATA, dtype="float32")
    with pytest.raises(ValueError, match="block must be one of"):
        LLMEngine(llama, block=48, num_blocks=8, use_graphs=False)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="compile_workers must be a positive int"):
            LLMEngine(llama, num_blocks=8, use_graphs=False, compile_workers=bad)
    for bad in (0, -1.0, float("inf"), float("nan"), True, "60"):
        with pytest.raises(ValueError, match="compile_timeout_s must be a positive number"):
            LLMEngine(llama, num_blocks=8, use_graphs=False, compile_timeout_s=bad)
    with pytest.raises(TypeError, match="compile_progress must be callable or None, got str"):
        LLMEngine(llama, num_blocks=8, use_graphs=False, compile_progress="print")


def test_one_requests_eos_ban_is_its_own(cpu, reference):
    """A request below its min_new_tokens has its own eos ids banned in its row, not another request's."""
    model = Llama.from_pretrained(DATA, dtype="float32")
    prompt = [3, 4, 5]
    other_stop = expected(reference, prompt, 6)[1]

    def first(with_other: bool):
        engine = LLMEngine(model, max_running=2, token_budget=32, block=16, num_blocks=12, max_len=64, use_graphs=False)
        prompts, sampling = [prompt], [dict(min_new_tokens=4)]
        if with_other:
            prompts.append([7, 8, 9])
            sampling.append(dict(stop_token_ids=[other_stop], min_new_tokens=4))
        return engine.generate(prompts, 6, sampling=sampling, temperature=0, ignore_eos=True)[0]["token_ids"]
    assert first(True) == first(False) == expected(reference, prompt, 6)


def test_a_resumed_request_whose_recompute_ends_in_a_decode(cpu, reference):
    """Preempted, a request recomputes its tokens in chunks; when they stop one short, its next pick is a decode
    whose slot must be set up as a first pick's is."""
    model = Llama.from_pretrained(DATA, dtype="float32")
    engine = LLMEngine(model, max_running=3, token_budget=19, block=16, num_blocks=7, max_len=64, chunk=8,
                       use_graphs=False)
    rng = np.random.default_rng(5)
    base = [int(t) for t in rng.integers(0, 256, 64)]
    prompts = [[int(t) for t in rng.integers(0, 256, 46)], base[:47], base[:23]]
    lengths = [12, 10, 14]
    reqs = run_ragged(engine, prompts, lengths, 1, temperature=0, ignore_eos=True)
    for r, p, n in zip(reqs, prompts, lengths):
        assert r.output == expected(reference, p, n), r.id
    assert engine.counters["preemptions"] > 0
