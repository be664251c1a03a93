"""The kernels Llama's model.py and the shared runtime call, as NumPy functions with the ops' semantics (outputs
written into the given views, caches updated in place), each from the op's float64 reference: with `cupy` standing
for NumPy (tests/_numpy_cupy.py), the model's own step code (its fused QKV views, KV cache, and, tensor-parallel,
its shards and all-reduces) runs on the CPU."""

import numpy as np

from tests.models.deepseek_v2.numpy_kernels import (apply_rope, quant_linear, quantize_fp8, rms_norm, swiglu_linear,
                                                  write_kv)
from tilekit.kernels.attention import attention_reference
from tilekit.kernels.decode_attention import decode_attention_reference
from tilekit.kernels.embedding import embedding_reference
from tilekit.kernels.quantize_fp8 import fp8_codes


def embedding(ids, wte, *, out):
    out[...] = embedding_reference(ids, wte)


def linear(x, weight, *, weight_layout, residual=None, out=None):
    assert weight_layout == "out_in"
    y = np.asarray(x, np.float64) @ np.asarray(weight, np.float64).T
    if residual is not None:
        y += residual
    if out is None:
        return y.astype(x.dtype)
    out[...] = y
    return out


def attention(q, k, v, *, causal, out):
    out[...] = attention_reference(q, k, v, causal=causal)


def decode_attention(q, k_cache, v_cache, lengths, *, new_k, new_v, length_offset, out, k_scale=None, v_scale=None):
    nq = q.shape[2]
    if k_scale is not None:
        new_k, new_v = fp8_codes(new_k, k_scale), fp8_codes(new_v, v_scale)
    for b, n in enumerate(np.asarray(lengths) + length_offset):
        k_cache[b, :, n - nq:n], v_cache[b, :, n - nq:n] = new_k[b], new_v[b]
    out[...] = decode_attention_reference(q, k_cache, v_cache, lengths, length_offset=length_offset, k_scale=k_scale,
                                          v_scale=v_scale)


MODEL_KERNELS = ("embedding", "rms_norm", "apply_rope", "swiglu_linear")
# what the shared model code (models.base) and the KV cache (engine.kv_cache) call
BASE_KERNELS = ("attention", "linear", "quant_linear", "quantize_fp8", "rms_norm")
CACHE_KERNELS = ("attention", "decode_attention", "write_kv")
