"""The kernels DeepSeek-V2's model.py calls, as NumPy functions with the ops' semantics (outputs written into the
given views, caches and fixed-point streams updated in place), each from the op's float64 reference: with
`cupy` standing for NumPy, the model's own step code (its buffers, views, cache layout and routing constants)
runs on the CPU."""

import numpy as np

from tilekit.kernels.attention import attention_reference
from tilekit.kernels.head_linear import head_linear_reference
from tilekit.kernels.mla_decode_attention import mla_decode_attention_reference
from tilekit.kernels.mla_kv import mla_kv_reference
from tilekit.kernels.moe_permute import moe_permute_reference
from tilekit.kernels.moe_router import moe_router_reference
from tilekit.kernels.quant_linear import quant_linear_reference
from tilekit.kernels.quantize_fp8 import quantize_fp8_reference
from tilekit.kernels.rms_norm import rms_norm_reference
from tilekit.kernels.swiglu_linear import swiglu_reference
from tilekit.kernels.tiles import fixed_to_float, float_to_fixed
from tilekit.kernels.write_kv import write_kv_reference


def embedding(ids, wte, *, out):
    out[...] = float_to_fixed(wte[ids])


def fixed_cast(x, out):
    out[...] = fixed_to_float(x)
    return out


def rms_norm(x, weight, eps, *, rows=None, out):
    x = fixed_to_float(x) if x.dtype == np.int64 else x          # the fixed-point residual stream, read as it lies
    out[...] = rms_norm_reference(x if rows is None else x[rows], weight, eps)


def linear(x, weight, *, weight_layout, residual=None, out=None):
    assert weight_layout == "out_in" and residual is None
    y = np.asarray(x, np.float64) @ np.asarray(weight, np.float64).T
    if out is None:
        return y.astype(x.dtype)
    out[...] = y
    return out


def apply_rope(x, positions, cos, sin):
    """In place, from the tables (rope_reference's angles are recovered from them: cos/sin may be scaled)."""
    B, H, T, D = x.shape
    pos = np.asarray(positions).reshape(B, 1, T)
    c, s = cos[pos][..., :D // 2], sin[pos][..., :D // 2]
    x1, x2 = x[..., :D // 2].astype(np.float64), x[..., D // 2:].astype(np.float64)
    x[...] = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def write_kv(k, v, k_cache, v_cache, start, *, k_scale=None, v_scale=None):
    kc, vc = write_kv_reference(k, v, k_cache, v_cache, start, k_scale=k_scale, v_scale=v_scale)
    k_cache[...], v_cache[...] = kc, vc


def mla_kv(kv, k_pe, k, v, *, dn):
    ref_k, ref_v = mla_kv_reference(kv, k_pe, dn)
    k[...], v[..., :ref_v.shape[-1]] = ref_k, ref_v


def attention(q, k, v, *, causal, scale, out):
    out[...] = attention_reference(q, k, v, causal=causal, scale=scale)


def head_linear(x, weight, *, out, weight_layout):
    out[...] = head_linear_reference(x, weight, weight_layout)


def mla_decode_attention(q, q_pe, c_cache, pe_cache, lengths, *, scale, new_c, new_pe, length_offset, out):
    nq = q.shape[2]
    for b, n in enumerate(np.asarray(lengths) + length_offset):
        c_cache[b, n - nq:n], pe_cache[b, n - nq:n] = new_c[b], new_pe[b]
    out[...] = mla_decode_attention_reference(q, q_pe, c_cache, pe_cache, lengths, scale=scale,
                                              length_offset=length_offset)


def moe_router(x, gate_weight, top_k, *, scale, shared, topk_ids, topk_weights):
    topk_ids[...], topk_weights[...] = moe_router_reference(x, gate_weight, top_k, scale=scale, shared=shared)


def moe_permute(topk_ids, n_experts, *, offsets, sorted_pairs):
    offsets[...], sorted_pairs[...] = moe_permute_reference(topk_ids, n_experts)


def _rows(offsets):
    """(expert, row range) of each expert's run of sorted rows."""
    return [(e, slice(offsets[e], offsets[e + 1])) for e in range(len(offsets) - 1) if offsets[e + 1] > offsets[e]]


def moe_gate_up(x, gate_up_proj, offsets, sorted_pairs, *, out):
    slots = len(sorted_pairs) // x.shape[0]
    half = gate_up_proj.shape[1] // 2
    for e, rows in _rows(offsets):
        a = np.asarray(x, np.float64)[sorted_pairs[rows] // slots]
        w = np.asarray(gate_up_proj[e], np.float64)
        out[rows] = swiglu_reference(a @ w[:half].T, a @ w[half:].T)


def moe_down_combine(act, down_proj, topk_weights, offsets, sorted_pairs, acc):
    slots = topk_weights.shape[1]
    for e, rows in _rows(offsets):
        pairs = sorted_pairs[rows]
        y = np.asarray(act[rows], np.float64) @ np.asarray(down_proj[e], np.float64).T
        y *= topk_weights.reshape(-1)[pairs][:, None]
        np.add.at(acc, pairs // slots, float_to_fixed(y))


def swiglu_linear(x, gate_weight, up_weight, *, out):
    x = np.asarray(x, np.float64)
    out[...] = swiglu_reference(x @ np.asarray(gate_weight, np.float64).T, x @ np.asarray(up_weight, np.float64).T)


def quant_linear(x, weight, weight_scale, *, weight_dtype, x_scale=None, activation=None, residual=None, out):
    out[...] = quant_linear_reference(x, weight, weight_scale, weight_dtype=weight_dtype, x_scale=x_scale,
                                      activation=activation, residual=residual)
    return out


def quantize_fp8(x, codes, scale, *, group=None):
    codes[...], scale[...] = quantize_fp8_reference(x, group)


# base.project's kernels (the quantized linears) go with them, and the latent cache's (engine.kv_cache)
BASE_KERNELS = ("linear", "quant_linear", "quantize_fp8")
CACHE_KERNELS = ("write_kv", "mla_decode_attention")
KERNELS = ("embedding", "fixed_cast", "rms_norm", "linear", "apply_rope", "write_kv", "mla_kv", "attention",
           "head_linear", "moe_router", "moe_permute", "moe_gate_up", "moe_down_combine",
           "swiglu_linear")
