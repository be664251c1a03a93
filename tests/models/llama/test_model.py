"""The Llama model on the GPU: against Hugging Face's logits and greedy tokens (the committed tiny checkpoints),
against the float64 NumPy reference at real Llama layer shapes, its KV-cache, graph and workload paths, and
from_pretrained / save_pretrained (streamed into the model's own arrays; host memory bounded)."""

import gc
import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from tilekit.kernels.checks import rel_err

cupy = pytest.importorskip("cupy")

from tilekit.models import LLAMA_PRESETS, Llama, LlamaConfig, ReferenceLlama  # noqa: E402
from tilekit import checkpoints as hf
from tilekit.models.llama.weights import random_state_dict  # noqa: E402

pytestmark = pytest.mark.gpu

DATA = Path(__file__).resolve().parents[2] / "data"
FIXTURES = ["tiny-llama", "tiny-llama-tied"]       # GQA + llama3 rope + untied + sharded; MQA + tied
MODEL_TOL = {"float32": 1e-5, "bfloat16": 2e-2}


@pytest.mark.parametrize("name", FIXTURES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_match_hugging_face(name, dtype):
    model = Llama.from_pretrained(DATA / name, dtype=dtype)
    ids = np.load(DATA / name / "input_ids.npy")
    err = rel_err(cupy.asnumpy(model(ids)).astype(np.float64), np.load(DATA / name / "logits.npy"))
    assert err <= MODEL_TOL[dtype], (name, dtype, err)


@pytest.mark.parametrize("name", FIXTURES)
def test_greedy_tokens_match_hugging_face(name):
    model = Llama.from_pretrained(DATA / name, dtype="float32")
    ids = np.load(DATA / name / "input_ids.npy")
    expected = np.load(DATA / name / "greedy_ids.npy")
    out = model.generate(ids, expected.shape[1] - ids.shape[1], temperature=0)
    np.testing.assert_array_equal(np.stack(out), expected)
    eager = model.generate(ids, expected.shape[1] - ids.shape[1], temperature=0, use_graph=False)
    np.testing.assert_array_equal(np.stack(eager), expected)


@pytest.mark.parametrize("preset", ["llama-3.2-1b", "llama-3.1-8b", "tinyllama-1.1b"])
def test_logits_match_reference_at_preset_shapes(preset):
    """Every per-layer shape of the preset (one layer and a smaller vocabulary keep the float64 reference quick)."""
    config = LLAMA_PRESETS[preset].replace(n_layer=1, vocab_size=1031, bos_token_id=1, eos_token_id=2)
    state = random_state_dict(config, seed=1)
    reference = ReferenceLlama(config, state)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 37))
    expected = reference.forward(ids)
    for dtype in ("float32", "bfloat16"):
        err = rel_err(cupy.asnumpy(Llama(config, dtype=dtype, state=state)(ids)).astype(np.float64), expected)
        assert err <= MODEL_TOL[dtype], (preset, dtype, err)


@pytest.fixture(scope="module")
def small_llama():
    config = LlamaConfig(n_layer=2, n_head=8, n_kv_head=2, n_embd=256, intermediate_size=688, vocab_size=1031,
                         max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    return Llama(config, dtype="float32", seed=3)


def test_kv_cache_greedy_equals_recomputation(small_llama):
    prompts = [[5, 17, 900, 4], [3, 1, 4, 1, 5, 9, 2, 6, 5], [42]]   # different lengths in one batch
    out = small_llama.generate(prompts, 12, temperature=0)
    for prompt, seq in zip(prompts, out):
        expected = list(prompt)
        for _ in range(12):
            expected.append(int(np.argmax(cupy.asnumpy(small_llama(np.array([expected])))[0, -1])))
        assert seq.tolist() == expected


def test_random_device_weights_are_deterministic_and_scaled():
    config = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=128, intermediate_size=256, vocab_size=300,
                         max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    a, b = Llama(config, dtype="float32", seed=7), Llama(config, dtype="float32", seed=7)
    ids = np.array([[1, 2, 3, 4]])
    np.testing.assert_array_equal(cupy.asnumpy(a(ids)), cupy.asnumpy(b(ids)))
    state = a.state_dict()
    assert abs(float(np.std(state["model.layers.0.self_attn.q_proj.weight"])) - 0.02) < 0.002
    assert abs(float(np.mean(state["model.norm.weight"])) - 1.0) < 0.05


def test_save_round_trip(tmp_path):
    model = Llama.from_pretrained(DATA / "tiny-llama", dtype="float32")
    model.save_pretrained(tmp_path)
    again = Llama.from_pretrained(tmp_path, dtype="float32")
    ids = np.load(DATA / "tiny-llama" / "input_ids.npy")
    np.testing.assert_array_equal(cupy.asnumpy(model(ids)), cupy.asnumpy(again(ids)))
    saved = ReferenceLlama.from_pretrained(tmp_path).forward(ids)
    assert rel_err(saved, np.load(DATA / "tiny-llama" / "logits.npy")) <= 1e-5


def test_the_tuning_workload_is_what_forward_and_generate_request(small_llama):
    from tilekit.autotune.op import recording
    with recording() as calls:
        small_llama(np.array([[1, 2, 3]] * 2), use_graph=False)
    assert {(op.name, op.problem_key(p)[1]) for op, p in calls} == \
        {(op.name, op.problem_key(p)[1]) for op, p in small_llama.kernel_problems(2, 3)}
    with recording() as calls:
        small_llama.generate([[1, 2, 3, 4, 5]], 3, temperature=0, use_graph=False)
        small_llama.generate([[1, 2, 3, 4, 5]], 3, temperature=1.0, top_k=50, use_graph=False)   # HF's default sampling
    assert {(op.name, op.problem_key(p)[1]) for op, p in calls} == \
        {(op.name, op.problem_key(p)[1]) for op, p in small_llama.kernel_problems(1, 5, 3)}


def bits(a) -> np.ndarray:
    a = cupy.asnumpy(a) if isinstance(a, cupy.ndarray) else a
    return a.view(f"u{a.dtype.itemsize}")


@pytest.mark.parametrize("name", FIXTURES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_from_pretrained_streams_into_the_models_own_arrays(name, dtype):
    """Every weight on the GPU bit for bit as the host loader converts it; q, k and v are rows of the fused qkv."""
    model = Llama.from_pretrained(DATA / name, dtype=dtype)
    host = Llama.weights.load(model.checkpoint, model.config, dtype=dtype, device=hf.HostDevice())
    assert model.params.keys() == host.keys()
    for key, array in model.params.items():
        assert isinstance(array, cupy.ndarray) and array.dtype == host[key].dtype, key
        assert np.array_equal(bits(array), bits(host[key])), key
    q, kv = model.config.n_head * model.config.head_dim, model.config.n_kv_head * model.config.head_dim
    for i, block in enumerate(model.blocks):
        p = f"model.layers.{i}.self_attn."
        assert [model.params[p + f"{n}_proj.weight"].data.ptr for n in "qkv"] == [
            block.qkv.data.ptr + rows * block.qkv.shape[1] * block.qkv.itemsize for rows in (0, q, q + kv)]


def test_a_tied_lm_head_in_the_file_is_compared_on_the_gpu(tmp_path):
    ck = hf.find_checkpoint(DATA / "tiny-llama-tied")
    config = LlamaConfig.from_fields(ck.config())
    tensors = Llama.weights.load(ck, config, dtype="bfloat16", device=hf.HostDevice())
    embedding = tensors["model.embed_tokens.weight"]
    hf.write_checkpoint(tmp_path, config.to_hf_dict(), dict(tensors, **{"lm_head.weight": embedding}),
                        dtype="bfloat16")
    model = Llama.from_pretrained(tmp_path, dtype="bfloat16")
    assert "lm_head.weight" not in model.params and model.head is model.embed
    changed = embedding.copy()
    changed[3, 5] = -changed[3, 5] if changed[3, 5] != 0 else 1
    hf.write_checkpoint(tmp_path, config.to_hf_dict(), dict(tensors, **{"lm_head.weight": changed}), dtype="bfloat16")
    with pytest.raises(ValueError, match="tensor 'lm_head.weight' differs from 'model.embed_tokens.weight'"):
        Llama.from_pretrained(tmp_path, dtype="bfloat16")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_save_pretrained_writes_the_models_dtype_bit_for_bit(tmp_path, dtype):
    from safetensors import safe_open
    model = Llama.from_pretrained(DATA / "tiny-llama", dtype=dtype)
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "np") as f:
        for key, array in model.params.items():
            saved = f.get_tensor(key)
            assert saved.dtype == array.dtype and np.array_equal(bits(saved), bits(array)), key
    again = Llama.from_pretrained(tmp_path, dtype=dtype)
    assert all(np.array_equal(bits(a), bits(again.params[k])) for k, a in model.params.items())
    transformers = pytest.importorskip("transformers")
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path).state_dict()     # Hugging Face reads it
    for key, array in model.params.items():
        assert np.array_equal(theirs[key].float().numpy(), cupy.asnumpy(array).astype(np.float32)), key


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def test_from_pretrained_holds_no_host_copy_of_the_checkpoint(tmp_path):
    """A 0.75 GB bf16 checkpoint (hub-like shards): peak resident memory rises by the staging buffers (4 x 64 MiB)
    and a little, not by the checkpoint (the old loader held it twice in float32)."""
    config = LlamaConfig(n_layer=4, n_head=32, n_kv_head=8, n_embd=2048, intermediate_size=8192, vocab_size=32000,
                         max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    shapes = Llama.weights.state_dict_shapes(config)
    pool = (np.random.default_rng().standard_normal(max(map(math.prod, shapes.values())), np.float32) * 0.02
            ).astype(ml_dtypes.bfloat16)
    hf.write_checkpoint(tmp_path, config.to_hf_dict(), {n: pool[:math.prod(s)].reshape(s) for n, s in shapes.items()},
                        dtype="bfloat16", shard_bytes=300 << 20)
    first = pool[:8].copy()
    del pool
    Llama(config.replace(n_layer=1, vocab_size=8), dtype="bfloat16")     # CUDA, CuPy and the kernels' modules up
    hf.CupyDevice().staging(1)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:                   # reset VmHWM to the current VmRSS
        f.write("5")
    before = _status_kb("VmRSS")
    model = Llama.from_pretrained(tmp_path, dtype="bfloat16")
    peak = _status_kb("VmHWM") - before
    assert peak < (256 + 160) << 10, peak                            # KiB; the checkpoint is 750 MB
    assert np.array_equal(bits(model.params["lm_head.weight"][0, :8]), bits(first))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fp8_kv_cache_logits_stay_near_the_model_dtype_cache(dtype):
    """Random weights, a 300-token prompt and four decode steps: an FP8 cache (static scale) against the model's
    dtype's, within the bound measured on the CPU (tests/models/llama/test_kv_cache_fp8.py)."""
    from tests.engine.test_kv_cache_fp8 import FP8_LOGITS_BOUND
    from tests.models.steps import decode_logits
    config = LlamaConfig(n_layer=2, n_head=8, n_kv_head=2, n_embd=256, intermediate_size=688, vocab_size=1031,
                         max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)
    model = Llama(config, dtype=dtype, seed=5)
    rng = np.random.default_rng(0)
    prompts, follow = rng.integers(0, 1031, (2, 300)), rng.integers(0, 1031, (2, 4))
    plain, _ = decode_logits(model, prompts, follow, "auto")
    fp8, cache = decode_logits(model, prompts, follow, "fp8")
    assert cache.k.dtype == cupy.uint8 and np.isfinite(fp8).all()
    err = rel_err(fp8, plain)
    assert 0 < err <= FP8_LOGITS_BOUND, (dtype, err)


def test_a_checkpoints_kv_cache_scales_reach_the_fp8_cache(tmp_path):
    """A quantized checkpoint's per-layer KV-cache scales (calibrated here: each layer's key / value absmax / 448 in
    the model-dtype cache), saved and loaded back, are every head's scales of the FP8 cache, and its decode logits
    stay within the bound of tests/models/llama/test_kv_cache_fp8.py (which checks the same on the CPU)."""
    from tests.engine.test_kv_cache_fp8 import FP8_LOGITS_BOUND
    from tests.models.steps import decode_logits
    from tilekit.kernels.checks import host
    config = LlamaConfig(n_layer=2, n_head=8, n_kv_head=2, n_embd=256, intermediate_size=688, vocab_size=1031,
                         max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    Llama(config, dtype="bfloat16", seed=6).save_pretrained(tmp_path / "float")
    model = Llama.from_pretrained(tmp_path / "float", quantize="fp8")
    rng = np.random.default_rng(1)
    prompts, follow = rng.integers(0, 1031, (2, 300)), rng.integers(0, 1031, (2, 4))
    plain, exact = decode_logits(model, prompts, follow, "auto")
    n = prompts.shape[1] + follow.shape[1]
    k, v = (np.abs(host(values)[:, :, :, :n]).max((1, 2, 3, 4)).astype(np.float32) / 448
            for values in (exact.k, exact.v))
    model.kv_scales = (k, v)
    model.save_pretrained(tmp_path / "fp8")
    loaded = Llama.from_pretrained(tmp_path / "fp8")
    fp8, cache = decode_logits(loaded, prompts, follow, "fp8")
    np.testing.assert_array_equal(cupy.asnumpy(cache.k_scale), np.repeat(k[:, None], config.n_kv_head, 1))
    np.testing.assert_array_equal(cupy.asnumpy(cache.v_scale), np.repeat(v[:, None], config.n_kv_head, 1))
    assert np.isfinite(fp8).all()
    err = rel_err(fp8, plain)
    assert 0 < err <= FP8_LOGITS_BOUND, err


def test_fp8_kv_cache_generate_with_graphs_equals_eager(small_llama):
    prompts = [[5, 17, 900, 4], [3, 1, 4, 1, 5, 9, 2, 6, 5]]
    graphed = small_llama.generate(prompts, 12, temperature=0, kv_cache_dtype="fp8")
    eager = small_llama.generate(prompts, 12, temperature=0, kv_cache_dtype="fp8", use_graph=False)
    assert [s.tolist() for s in graphed] == [s.tolist() for s in eager]


def test_a_chunked_prefill_generates_the_whole_prefills_tokens():
    """generate() with prompts longer than prefill_chunk (a ragged batch, fp32): the chunks' attention over the cached
    positions, on the GPU's kernels, gives the whole prefill's greedy tokens."""
    model = Llama.from_pretrained(DATA / "tiny-llama", dtype="float32")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, model.config.vocab_size, n) for n in (300, 229)]
    runs = {}
    for chunk in (0, 64):
        model.prefill_chunk = chunk
        runs[chunk] = model.generate(prompts, 16, temperature=0, eos_token_id=[])
        model.forget_graphs()
    for whole, chunked in zip(runs[0], runs[64]):
        np.testing.assert_array_equal(whole, chunked)
