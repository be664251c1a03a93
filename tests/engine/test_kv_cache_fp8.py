"""Llama's FP8 KV cache on the CPU (NumPy standing in for CuPy and for each kernel, numpy_kernels.py): the cache
holds e4m3 codes with per-(layer, head) scales, the prefill and decode steps write what write_kv and
decode_attention write, and the decode logits stay within a stated bound of the model-dtype cache's."""

import json
from pathlib import Path

import numpy as np
import pytest

from tests._numpy_cupy import numpy_cupy, step_code_on_numpy  # noqa: F401  (numpy_cupy: a fixture)
from tests.models.llama import numpy_kernels
from tests.models.steps import decode_logits
from tilekit.engine.kv_cache import new_cache
from tilekit.kernels.checks import rel_err
from tilekit.kernels.quantize_fp8 import fp8_values
from tilekit.engine import kv_cache
from tilekit.models import DeepseekV2, DeepseekV2Config, Llama, base
from tilekit.models.llama import model as model_module
from tilekit.models.base import Arrays

DATA = Path(__file__).resolve().parents[1] / "data"
# e4m3 keeps 3 significant bits (a normal code within 1/16 of its value; the cached keys' relative error measured
# 0.026 here): after attention's averaging, the tiny random-weight models' decode logits moved by 0.004-0.006
# (relative error, three prompts each); the bounds leave room
FP8_LOGITS_BOUND = 0.02
FP8_CACHE_BOUND = 0.04


@pytest.fixture
def cpu(numpy_cupy, monkeypatch):
    step_code_on_numpy(numpy_cupy, monkeypatch, (model_module, numpy_kernels, numpy_kernels.MODEL_KERNELS),
                       (base, numpy_kernels, numpy_kernels.BASE_KERNELS), (kv_cache, numpy_kernels, numpy_kernels.CACHE_KERNELS))


def test_fp8_cache_logits_stay_near_the_model_dtype_cache(cpu):
    model = Llama.from_pretrained(DATA / "tiny-llama", dtype="float32")
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, model.config.vocab_size, (2, 20))
    follow = rng.integers(0, model.config.vocab_size, (2, 4))
    plain, exact = decode_logits(model, prompts, follow, "auto")
    fp8, cache = decode_logits(model, prompts, follow, "fp8")
    assert cache.k.dtype == np.uint8 and cache.k_scale.shape == (model.config.n_layer, model.config.n_kv_head)
    err = rel_err(fp8, plain)
    assert 0 < err <= FP8_LOGITS_BOUND, err
    # the cache holds e4m3 codes of what the plain cache holds, prompt and decoded tokens alike
    n = prompts.shape[1] + follow.shape[1]
    for codes, scales, values in ((cache.k, cache.k_scale, exact.k), (cache.v, cache.v_scale, exact.v)):
        assert rel_err(fp8_values(codes[0][:, :, :n], scales[0]), values[0][:, :, :n]) <= FP8_CACHE_BOUND


def test_bad_kv_cache_dtypes_are_refused(cpu):
    model = Llama.from_pretrained(DATA / "tiny-llama", dtype="float32")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, got 'int8'"):
        new_cache(model, 1, 64, Arrays(), "int8")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, got 'bf16'"):
        model.generate([[1, 2]], 2, kv_cache_dtype="bf16")
    latent = DeepseekV2(DeepseekV2Config.preset("deepseek-v2-lite"), meta=True)
    with pytest.raises(ValueError, match="latent cache is kept in the model's dtype"):
        new_cache(latent, 1, 64, Arrays(meta=True), "fp8")


def test_a_checkpoints_kv_cache_scales_scale_the_fp8_cache_and_save_back(cpu, tmp_path):
    """Static per-layer scales of a quantized checkpoint (calibrated here as each layer's key / value absmax / 448
    from the model-dtype cache) become every head's scales of the FP8 cache: its codes decode to the plain cache's
    values and the logits stay within the bound; save_pretrained writes them back (compressed-tensors'
    kv_cache_scheme) and they load again."""
    model = Llama.from_pretrained(DATA / "tiny-llama", dtype="float32", quantize="fp8")
    assert model.kv_scales is None
    rng = np.random.default_rng(1)
    prompts = rng.integers(0, model.config.vocab_size, (2, 20))
    follow = rng.integers(0, model.config.vocab_size, (2, 4))
    plain, exact = decode_logits(model, prompts, follow, "auto")
    n = prompts.shape[1] + follow.shape[1]
    k, v = (np.abs(values[:, :, :, :n]).max((1, 2, 3, 4)).astype(np.float32) / 448 for values in (exact.k, exact.v))
    model.kv_scales = (k, v)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]["strategy"] \
        == "tensor"
    loaded = Llama.from_pretrained(tmp_path, dtype="float32")
    np.testing.assert_array_equal(loaded.kv_scales[0], k)
    np.testing.assert_array_equal(loaded.kv_scales[1], v)
    fp8, cache = decode_logits(loaded, prompts, follow, "fp8")
    np.testing.assert_array_equal(cache.k_scale, np.repeat(k[:, None], model.config.n_kv_head, 1))
    np.testing.assert_array_equal(cache.v_scale, np.repeat(v[:, None], model.config.n_kv_head, 1))
    assert 0 < rel_err(fp8, plain) <= FP8_LOGITS_BOUND
    for layer in range(model.config.n_layer):
        for codes, scales, values in ((cache.k, cache.k_scale, exact.k), (cache.v, cache.v_scale, exact.v)):
            assert rel_err(fp8_values(codes[layer][:, :, :n], scales[layer]), values[layer][:, :, :n]) \
                <= FP8_CACHE_BOUND, layer


def test_kv_scales_set_by_hand_are_checked_where_they_are_used(cpu, tmp_path):
    model = Llama.from_pretrained(DATA / "tiny-llama", dtype="float32", quantize="fp8")
    layers = model.config.n_layer
    for scales, match in [((np.ones(layers + 1), np.ones(layers)), f"kv_scales: {layers + 1} key scales for {layers} "
                                                                    "layers"),
                          ((np.ones(layers), np.full(layers, np.nan)), "kv_scales: layer 0's value scale is nan"),
                          ((np.ones(layers), -np.ones(layers)), "kv_scales: layer 0's value scale is -1.0"),
                          (np.ones(layers), r"kv_scales must be \(key scales, value scales\)")]:
        model.kv_scales = scales
        with pytest.raises(ValueError, match=match):
            new_cache(model, 1, 64, Arrays(), "fp8")
        with pytest.raises(ValueError, match=match):
            model.save_pretrained(tmp_path / "q")
    plain = Llama.from_pretrained(DATA / "tiny-llama", dtype="float32")
    plain.kv_scales = (np.ones(layers), np.ones(layers))
    with pytest.raises(ValueError, match="kv_scales are saved with a quantized model's compressed-tensors checkpoint"):
        plain.save_pretrained(tmp_path / "f")
